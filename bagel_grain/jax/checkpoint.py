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

Each shard file names the save it belongs to (`save`: the step and a run identity
all processes share; the process count, rows per batch and batches taken, which
`bagel-grain replay` reads), so a step holding a file of another save is refused, as is
one whose files do not make up exactly the shards of its count. Process 0 also
writes `data/data_manifest.json`, the files each dataset held: a restore onto
changed data names the files that changed, and tells records appended from records
rewritten; and, once records were appended at a restore, `data/data_eras.json`, the
files of each group's earlier record sets (`packing/eras.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import secrets
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from etils import epath

from bagel_grain.errors import StateMismatchError
from bagel_grain.jax.global_batch import DevicePrefetchIterator
from bagel_grain.packing import shards
from bagel_grain.packing.batch import BatchIterator
from bagel_grain.sources.manifest import Manifest

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
  the next save or exit). An iterator's ledger is written first: a checkpoint never
  holds a position the ledger has not reached.
  """
  if isinstance(iterator, DevicePrefetchIterator) and iterator.ledger is not None:
    iterator.ledger.flush()
  saved = manager.save(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardSave(state),
      DATA: ShardStatesSave(iterator, save=save_facts(step, iterator))}))
  if wait:
    manager.wait_until_finished()
  return saved


def save_facts(step: int, iterator: grain.DatasetIterator) -> dict[str, Any]:
  """What a save records beside the position: the step and run identity (checked at
  restore), and what a replay needs to rebuild the stream (the same in every process)."""
  facts = {"step": int(step), "run": run_identity(), "processes": jax.process_count()}
  if isinstance(iterator, DevicePrefetchIterator):
    facts["batches"] = iterator.batches_taken
    iterator = iterator.host_iterator
  if isinstance(iterator, BatchIterator):
    facts["batch_size"] = iterator.batch_size
  return facts


_RUN: list[str] = []


def run_identity() -> str:
  """This run's identity, the same in every process (process 0's draw, shared once)."""
  if not _RUN:
    mine = int.from_bytes(secrets.token_bytes(4), "little")
    shared = multihost_utils.broadcast_one_to_all(np.int32(mine & 0x7FFFFFFF))
    _RUN.append(f"{int(shared):08x}")
  return _RUN[0]


def restore(manager: ocp.CheckpointManager, step: int | None, state_template: Any,
            iterator: grain.DatasetIterator, *, allow_changes: bool = False) -> Any:
  """Restores `iterator` in place (it continues after the saved position) and returns the state.

  `state_template` gives the structure, shapes, dtypes and shardings of the
  restored arrays (arrays or `jax.ShapeDtypeStruct`s). `step=None` takes the
  latest step. `allow_changes`: continue across the changes a new stage of training
  makes (weights, groups added or removed at the end; docs/changes.md).
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {manager.directory}")
  restored = manager.restore(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardRestore(state_template),
      DATA: ShardStatesRestore(iterator, allow_changes=allow_changes, step=step)}))
  if isinstance(iterator, DevicePrefetchIterator) and iterator.ledger is not None:
    iterator.ledger.begin(iterator.batches_taken, restored=True)  # every process, together
  return restored[STATE]


_SHARD_FILE = re.compile(r"shard_state_(\d+)-of-(\d+)\.json")


def shard_files(directory: epath.Path) -> dict[str, re.Match]:
  """A step's data folder: its shard files by name (the match: shard, count)."""
  return {f.name: m for f in directory.iterdir() if (m := _SHARD_FILE.fullmatch(f.name))}


@contextlib.contextmanager
def _naming(paths):
  """A damaged or foreign saved state: an error that names the files it came from."""
  try:
    yield
  except (json.JSONDecodeError, StateMismatchError) as e:
    raise StateMismatchError(f"cannot restore the data iterator from "
                             f"{', '.join(map(str, paths))}: {e}") from e


_MANIFEST, _ERAS = "data_manifest.json", "data_eras.json"


class ShardStatesHandler:
  """Orbax handler of the pipeline iterator: one JSON file per logical shard.

  Falls back to Grain's per-process file for iterators whose state is not the
  pipeline's (e.g. the pipeline wrapped in further Grain transformations), and
  reads that file from checkpoints written before logical shards.
  """

  def save(self, directory: epath.Path, item: Any = None, args: Any = None) -> None:
    item = item if item is not None else args.item
    state = item.get_state()
    if not shards.is_sharded(state):
      grain.checkpoint.CheckpointHandler().save(directory,
                                                args=grain.checkpoint.CheckpointSave(item))
      return
    count = shards.shard_count(state)
    for shard, part in shards.split_state(state).items():
      (directory / f"shard_state_{shard}-of-{count}.json").write_text(
          json.dumps({**part, "save": args.save}, indent=1))
    if jax.process_index() == 0:
      manifests = {group: {name: m.to_json() for name, m in datasets.items()}
                   for group, datasets in item.manifests().items()}
      (directory / _MANIFEST).write_text(json.dumps(manifests))
      eras = {group: [{name: m.to_json() for name, m in s.items()} for s in sets]
              for group, sets in item.era_manifests().items()}
      if eras:
        (directory / _ERAS).write_text(json.dumps(eras))

  def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
    item = item if item is not None else args.item
    served = item.get_state()
    files = shard_files(directory)
    if not shards.is_sharded(served) or not files:  # Grain's per-process file (also from before
      process_file = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
      with _naming([process_file]):  # logical shards)
        return grain.checkpoint.CheckpointHandler().restore(
            directory, args=grain.checkpoint.CheckpointRestore(item))
    save = restore_shard_states(directory, item, step=args.step,
                                allow_changes=args.allow_changes)
    if isinstance(item, DevicePrefetchIterator):
      item.batches_taken = batches_taken(save, args.step)
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


def restore_shard_states(directory: epath.Path, item: Any, *, step: int | None,
                         allow_changes: bool = False) -> dict[str, Any] | None:
  """Restores `item` (the pipeline's iterator, or one wrapping it) from a checkpoint
  step's shard files: those of the shards it serves, all checked to make up one save
  of `step`. Returns that save's facts (`save_facts`; None before they were kept)."""
  served = item.get_state()
  files = shard_files(directory)
  count = shards.shard_count(served)
  saved_counts = {int(m.group(2)) for m in files.values()}
  if saved_counts != {count}:
    raise StateMismatchError(
        f"the checkpoint in {directory} holds logical shards of {sorted(saved_counts)} "
        f"(logical_shards: saved {sorted(saved_counts)}, now {count}): restore with the "
        "logical_shards it was saved with (unset means one per process)")
  present = {int(m.group(1)) for m in files.values()}
  if present != set(range(count)):
    extra = sorted(n for n, m in files.items() if int(m.group(1)) >= count)
    missing = sorted(set(range(count)) - present)
    raise StateMismatchError(
        f"the checkpoint in {directory} does not hold exactly the {count} logical shards "
        f"it was saved with (files of no such shard: {extra or 'none'}; shards without a "
        f"file: {missing or 'none'}): a copy gone wrong? Restore from a complete step")
  _check_one_save(directory, sorted(files), step)
  paths = [directory / f"shard_state_{shard}-of-{count}.json"
           for shard in shards.served(served)]
  parts = []
  for path in paths:
    with _naming([path]):
      parts.append(json.loads(path.read_text()))
  with _naming(paths):
    joined = shards.joined_states(parts)
    save = joined.pop("save", None)
    item.set_state(joined, allow_changes=allow_changes,
                   saved_manifests=_manifests(directory / _MANIFEST),
                   saved_eras=_era_manifests(directory / _ERAS))
  return save


def batches_taken(save: Any, step: int | None) -> int:
  """Batches the iterator had handed out at a save; a save before they were counted
  says its step (the usual loop saves step N after N batches)."""
  if isinstance(save, dict) and isinstance(save.get("batches"), int):
    return save["batches"]
  return int(step or 0)


def _check_one_save(directory: epath.Path, names: list[str], step: int | None) -> None:
  """Every shard file of the step (not only those this process reads) names one save, and
  that save is of `step`; files written before saves were named pass."""
  saves: dict[str, list[str]] = {}
  for name in names:
    with _naming([directory / name]):
      part = json.loads((directory / name).read_text())
    save = part.get("save") if isinstance(part, dict) else None
    saves.setdefault(json.dumps(save, sort_keys=True), []).append(name)
  if len(saves) > 1:
    found = "; ".join(f"{', '.join(files)} from {save}" for save, files in saves.items())
    raise StateMismatchError(f"the checkpoint in {directory} mixes shard files of different "
                             f"saves ({found}): a copy gone wrong, a partial sync? Restore "
                             "from a complete step")
  save = json.loads(next(iter(saves)))
  if step is not None and isinstance(save, dict) and save.get("step") != step:
    raise StateMismatchError(f"the shard files in {directory} were saved at step "
                             f"{save.get('step')}, not at step {step} being restored: a copy "
                             "gone wrong? Restore from a complete step")


def _manifests(path: epath.Path) -> dict[str, dict[str, Manifest]] | None:
  """The data manifests a checkpoint kept (None for one written before they were kept)."""
  if not path.exists():
    return None
  with _naming([path]):
    try:
      return {group: {name: Manifest.from_json(m) for name, m in datasets.items()}
              for group, datasets in json.loads(path.read_text()).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise StateMismatchError(f"malformed data manifest ({type(e).__name__}: {e})") from e


def _era_manifests(path: epath.Path) -> dict[str, list[dict[str, Manifest]]] | None:
  """The earlier record sets' manifests a checkpoint kept (None when it kept none)."""
  if not path.exists():
    return None
  with _naming([path]):
    try:
      return {group: [{name: Manifest.from_json(m) for name, m in s.items()} for s in sets]
              for group, sets in json.loads(path.read_text()).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise StateMismatchError(f"malformed data eras ({type(e).__name__}: {e})") from e


@ocp.args.register_with_handler(ShardStatesHandler, for_save=True)
@dataclasses.dataclass
class ShardStatesSave(ocp.args.CheckpointArgs):
  item: Any
  save: dict[str, Any] = dataclasses.field(default_factory=dict)  # step and run identity


@ocp.args.register_with_handler(ShardStatesHandler, for_restore=True)
@dataclasses.dataclass
class ShardStatesRestore(ocp.args.CheckpointArgs):
  item: Any
  allow_changes: bool = False
  step: int | None = None  # the step restored, which every shard file must name
