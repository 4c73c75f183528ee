"""The host/device boundary: process-local batches -> global sharded `jax.Array`s, prefetched.

Each JAX process packs its own `[B_local, ...]` rows (docs/design.md, section 7);
`jax.make_array_from_process_local_data` joins them into `[B_local * processes,
...]` arrays sharded over the mesh's data axes. `sample_keys` stay on the host.
`DevicePrefetchIterator` does this a few batches ahead in a thread and keeps the
Grain state of the last batch handed out, so a checkpoint taken between steps
resumes exactly after the batches the trainer consumed; with a ledger
(`bagel_grain.ledger`) it records the samples of every batch the trainer takes.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import grain
import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bagel_grain.ledger import Ledger, step_rows

HOST_FIELDS = ("sample_keys",)


class DeviceBatch(NamedTuple):
  """A global batch: device arrays by field, and the host-only sample keys of local rows."""

  arrays: dict[str, jax.Array]
  sample_keys: list


def batch_partition_spec(data_axes: str | Sequence[str]) -> PartitionSpec:
  """Leading (batch) dimension over the data axes, every other dimension whole."""
  axes = data_axes if isinstance(data_axes, str) else tuple(data_axes)
  return PartitionSpec(axes)


def field_shardings(fields: Iterable[str], mesh: Mesh, *,
                    data_axes: str | Sequence[str] = "data",
                    replicated: Iterable[str] = ()) -> dict[str, NamedSharding]:
  """A `NamedSharding` per field: batch-sharded, or fully replicated for `replicated` ones."""
  replicated = set(replicated)
  batch = NamedSharding(mesh, batch_partition_spec(data_axes))
  whole = NamedSharding(mesh, PartitionSpec())
  return {name: whole if name in replicated else batch for name in fields}


def make_global_batch(batch: dict[str, Any], mesh: Mesh, *,
                      data_axes: str | Sequence[str] = "data",
                      replicated: Iterable[str] = ()) -> DeviceBatch:
  """One process's batch -> global arrays.

  Batch-sharded fields concatenate over processes along dim 0 (so the global
  batch is `B_local * process_count` when the data axes span all processes).
  A `replicated` field is not split: every process must pass the same value,
  which becomes the global value as is.
  """
  arrays = {name: value for name, value in batch.items() if name not in HOST_FIELDS}
  shardings = field_shardings(arrays, mesh, data_axes=data_axes, replicated=replicated)
  out = {name: jax.make_array_from_process_local_data(shardings[name], np.asarray(value))
         for name, value in arrays.items()}
  return DeviceBatch(out, list(batch.get("sample_keys", [])))


_BATCH, _END, _ERROR = "batch", "end", "error"


class DevicePrefetchIterator(grain.DatasetIterator):
  """Runs a host iterator and `to_device` a few batches ahead in a background thread.

  - `buffer_size` bounds the batches waiting on the device.
  - An exception in the producer (data or transfer) is re-raised by `__next__`
    in the consumer, and again on every later call; the end of a finite stream
    is `StopIteration`.
  - `get_state()` is the wrapped iterator's state after the last batch returned
    by `__next__` (not the one the thread reached), so Grain's Orbax handler
    saves the trainer's position; `set_state()` stops the thread, restores the
    wrapped iterator and starts again on the next call.
  - `close()` stops the thread and closes the wrapped iterator.
  - `batches_taken`: batches `__next__` returned since the stream's start (a restore
    through `bagel_grain.jax.restore` sets it to the saved count): the data step of the
    next batch, as the `ledger` records it.
  """

  def __init__(self, parent: grain.DatasetIterator, to_device: Callable[[dict], Any], *,
               buffer_size: int = 2, ledger: Ledger | None = None):
    super().__init__(parent)
    if buffer_size < 1:
      raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    self._to_device = to_device
    self._buffer_size = buffer_size
    self.ledger = ledger
    self.batches_taken = 0
    self._state = parent.get_state()
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._queue: queue.Queue = queue.Queue(buffer_size)
    self._failure: BaseException | None = None
    self._ended = False

  # -- producer ----------------------------------------------------------------

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.05)
        return True
      except queue.Full:
        continue
    return False

  def _produce(self) -> None:
    try:
      before = self._parent.get_state() if self.ledger is not None else None
      while not self._stop.is_set():
        host = next(self._parent)
        state = self._parent.get_state()
        lines = step_rows(host, before, state) if self.ledger is not None else None
        before = state
        if not self._put((_BATCH, (self._to_device(host), state, lines))):
          return
    except StopIteration:
      self._put((_END, None))
    except BaseException as e:  # pylint: disable=broad-exception-caught
      self._put((_ERROR, e))  # handed to the consumer, which re-raises it

  def start_prefetch(self) -> None:
    """Starts the producer thread (idempotent); `__next__` calls it too."""
    if self._thread is None and not self._closed:
      self._stop.clear()
      self._queue = queue.Queue(self._buffer_size)
      self._thread = threading.Thread(target=self._produce, name="bagel-grain-prefetch",
                                      daemon=True)
      self._thread.start()

  def _stop_thread(self) -> None:
    if self._thread is None:
      return
    self._stop.set()
    while self._thread.is_alive():
      try:  # unblock a producer waiting on a full queue
        self._queue.get(timeout=0.05)
      except queue.Empty:
        pass
    self._thread.join()
    self._thread = None

  # -- consumer ----------------------------------------------------------------

  def __next__(self):
    self._assert_not_closed()
    if self._failure is not None:
      raise self._failure
    if self._ended:
      raise StopIteration
    self.start_prefetch()
    kind, payload = self._queue.get()
    if kind == _END:
      self._ended = True
      raise StopIteration
    if kind == _ERROR:
      self._failure = payload
      raise payload
    batch, self._state, lines = payload
    if self.ledger is not None:
      self.ledger.record(self.batches_taken, lines)
    self.batches_taken += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return self._state

  def set_state(self, state: dict[str, Any], **options: Any) -> None:
    """The pipeline's `set_state` (`options`: `allow_changes`, `saved_manifests`,
    `saved_eras`)."""
    self._stop_thread()
    self._parent.set_state(state, **options)
    self._state = self._parent.get_state()
    self._failure, self._ended = None, False

  @property
  def host_iterator(self) -> grain.DatasetIterator:
    """The wrapped iterator of host batches."""
    return self._parent

  def manifests(self):
    """The pipeline's data manifests (what a checkpoint keeps)."""
    return self._parent.manifests()

  def era_manifests(self):
    """The pipeline's earlier record sets' manifests (what a checkpoint keeps)."""
    return self._parent.era_manifests()

  def close(self) -> None:
    if self._closed:
      return
    self._stop_thread()
    super().close()

  def __str__(self) -> str:
    return f"DevicePrefetchIterator(buffer_size={self._buffer_size})"


def device_iterator(dataset: grain.IterDataset | grain.DatasetIterator, mesh: Mesh, *,
                    data_axes: str | Sequence[str] = "data", replicated: Iterable[str] = (),
                    buffer_size: int = 2,
                    ledger: str | epath.PathLike | None = None) -> DevicePrefetchIterator:
  """The pipeline's batches as prefetched global `DeviceBatch`es (a checkpointable iterator).

  `ledger`: a folder (beside the checkpoints, e.g. `<checkpoints>/data_ledger`) where
  each process records the samples of every batch taken, written at each
  `bagel_grain.jax.save` (docs/debugging.md). Every process passes it; making the
  iterator then agrees on the ledger's generation across processes.
  """
  parent = dataset if isinstance(dataset, grain.DatasetIterator) else iter(dataset)
  replicated = tuple(replicated)

  def to_device(batch):
    return make_global_batch(batch, mesh, data_axes=data_axes, replicated=replicated)

  writer = None
  if ledger is not None:
    writer = Ledger(ledger, process_index=jax.process_index(),
                    process_count=jax.process_count(),
                    broadcast=multihost_utils.broadcast_one_to_all)
    writer.begin(0)
  return DevicePrefetchIterator(parent, to_device, buffer_size=buffer_size, ledger=writer)
