"""Orbax checkpoints that hold the data iterator beside the model state.

One checkpoint step is an Orbax `Composite` of two items:
`state` (any pytree of arrays, `StandardSave`) and `data` (the Grain iterator
through Grain's own handler, `grain.checkpoint.CheckpointSave`), which writes one
small JSON per JAX process (`data/process_<i>-of-<n>.json`). Works with the
plain pipeline iterator and with `DevicePrefetchIterator`, whose state is the
position after the last batch the trainer took.
"""

from __future__ import annotations

from typing import Any

import grain
import orbax.checkpoint as ocp

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
      DATA: grain.checkpoint.CheckpointSave(iterator)}))
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
      DATA: grain.checkpoint.CheckpointRestore(iterator)}))
  return restored[STATE]
