"""Orbax checkpoints that hold the data iterator beside the model state.

One checkpoint step is an Orbax `Composite` of two items: `state` (any pytree of
arrays, `StandardSave`) and `data`, the pipeline iterator's position, written
the way Grain's elastic iterator writes its shards: one small JSON per logical
shard, `data/shard_state_<s>-of-<S>.json`, each process writing the shards it
serves. A process restoring under any process count reads the files of the
shards it serves now, whichever process wrote them (docs/elastic.md). Works
with the plain pipeline iterator and with `DevicePrefetchIterator`, whose state
is the position after the last batch the trainer took; any other iterator is
saved per process by Grain's own handler (`data/process_<i>-of-<n>.json`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.shards import joined_states, split_state

STATE, DATA = "state", "data"


def checkpoint_manager(directory: str, *, max_to_keep: int | None = None,
                       **options: Any) -> ocp.CheckpointManager:
  """A `CheckpointManager` for `save`/`restore`; `options` go to `CheckpointManagerOptions`."""
  opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, **options)
  return ocp.CheckpointManager(directory, options=opts, item_names=(STATE, DATA))


def save(manager: ocp.CheckpointManager, step: int, state: Any,
         iterator: grain.DatasetIterator, *, wait: bool = True) -> bool:
  """Saves model `state` and the iterator's position at `step` (all processes call it).

  The iterator state is read now, synchronously; with `wait=False` the array
  writes finish in the background (call `manager.wait_until_finished()` before
  the next save or exit).
  """
  saved = manager.save(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardSave(state),
      DATA: ShardStatesSave(iterator)}))
  if wait:
    manager.wait_until_finished()
  return saved


def restore(manager: ocp.CheckpointManager, step: int | None, state_template: Any,
            iterator: grain.DatasetIterator) -> Any:
  """Restores `iterator` in place (it continues after the saved position) and returns the state.

  `state_template` gives the structure, shapes, dtypes and shardings of the
  restored arrays (arrays or `jax.ShapeDtypeStruct`s). `step=None` takes the
  latest step.
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {manager.directory}")
  restored = manager.restore(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardRestore(state_template),
      DATA: ShardStatesRestore(iterator)}))
  return restored[STATE]


_SHARD_FILE = re.compile(r"shard_state_(\d+)-of-(\d+)\.json")


@contextlib.contextmanager
def _naming(paths):
  """A damaged or foreign saved state: an error that names the files it came from."""
  try:
    yield
  except (json.JSONDecodeError, StateMismatchError) as e:
    raise StateMismatchError(f"cannot restore the data iterator from "
                             f"{', '.join(map(str, paths))}: {e}") from e


def _sharded(state: Any) -> bool:
  return isinstance(state, dict) and "shards" in state and "logical_shards" in state


class ShardStatesHandler:
  """Orbax handler of the pipeline iterator: one JSON file per logical shard.

  Falls back to Grain's per-process file for iterators whose state is not the
  pipeline's (e.g. the pipeline wrapped in further Grain transformations), and
  reads that file from checkpoints written before logical shards.
  """

  def save(self, directory: epath.Path, item: Any = None, args: Any = None) -> None:
    item = item if item is not None else args.item
    state = item.get_state()
    if not _sharded(state):
      grain.checkpoint.CheckpointHandler().save(directory,
                                                args=grain.checkpoint.CheckpointSave(item))
      return
    count = state["logical_shards"]
    for shard, part in split_state(state).items():
      (directory / f"shard_state_{shard}-of-{count}.json").write_text(json.dumps(part, indent=1))

  def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
    item = item if item is not None else args.item
    served = item.get_state()
    saved_counts = {int(m.group(2)) for f in directory.iterdir()
                    if (m := _SHARD_FILE.fullmatch(f.name))}
    if not _sharded(served) or not saved_counts:  # Grain's per-process file (also from before
      process_file = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
      with _naming([process_file]):  # logical shards)
        return grain.checkpoint.CheckpointHandler().restore(
            directory, args=grain.checkpoint.CheckpointRestore(item))
    count = served["logical_shards"]
    if saved_counts != {count}:
      raise StateMismatchError(
          f"the checkpoint in {directory} holds logical shards of {sorted(saved_counts)} "
          f"(logical_shards: saved {sorted(saved_counts)}, now {count}): restore with the "
          "logical_shards it was saved with (unset means one per process)")
    paths = [directory / f"shard_state_{shard}-of-{count}.json" for shard in served["shards"]]
    parts = []
    for shard, path in zip(served["shards"], paths):
      if not path.exists():
        raise StateMismatchError(f"{path} is missing: this process serves logical shard "
                                 f"{shard} of {count}")
      with _naming([path]):
        parts.append(json.loads(path.read_text()))
    with _naming(paths):
      item.set_state(joined_states(parts))
    item.start_prefetch()
    return item

  # The rest of Orbax's CheckpointHandler interface: nothing to do for small JSON files.
  def structure(self, directory: epath.Path) -> Any:
    del directory

  def metadata(self, directory: epath.Path) -> Any:
    del directory

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass

  @classmethod
  def typestr(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(ShardStatesHandler, for_save=True)
@dataclasses.dataclass
class ShardStatesSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(ShardStatesHandler, for_restore=True)
@dataclasses.dataclass
class ShardStatesRestore(ocp.args.CheckpointArgs):
  item: Any
