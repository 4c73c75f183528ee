"""Batching: each packed row written straight into its slot of a static-shape batch.

Rows are written in place (pixels are copied once, from the sample into the
batch), into batch buffers reused once the caller has let go of them
(`packing.buffers`: the arrays handed out are read-only, and a batch still held,
or a view of it, is never written again). Each batch carries `sample_keys` per row; a finite stream's last batch is
padded with empty rows. This is the pipeline's outer stage: its state is that of
the rows it batches (a packing stage, or the interleaving of a process's logical
shards), sealed with a version and the stream's fingerprint.

Each `next()` is one transaction: the stages' position is saved before it and put
back when it raises (an error, a Ctrl-C), so no sample is lost or drawn twice;
at the stream's end it keeps what it drew on the way. `get_state()` and `stats()`
from another thread see the position before the `next()` in progress; two
threads calling `next()` take turns.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, NoReturn, Sequence

import grain

from bagel_grain.errors import StateMismatchError, UnsupportedOperationError
from bagel_grain.packed_row import PackedBatch
from bagel_grain.packing import eras as era_keys
from bagel_grain.packing import state as envelope
from bagel_grain.packing.pack import PackDataset, PackIterator, PackPosition
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.buffers import BatchBuffers
from bagel_grain.packing.row import Capacities, batch_row, write_row
from bagel_grain.packing.shards import (InterleavePosition, ShardInterleaveDataset,
                                        ShardInterleaveIterator)
from bagel_grain.packing.stage import StageIterator, interrupts_held
from bagel_grain.sources.manifest import Manifest
from bagel_grain.sources.records import EraStart

SampleKeys = tuple[tuple[str, int, int, str], ...]
# The rows again on other record sets, and where each later set starts per shard (pipeline).
Rebuild = Callable[[era_keys.Plan], tuple[ShardInterleaveDataset, dict[int, dict[str, list[int]]]]]


class BatchDataset(grain.IterDataset):
  """Batches of `batch_size` packed rows: `PackedBatch` dicts of numpy arrays.

  Grain operations that would take the stream apart refuse with what to use instead.
  """

  def __init__(self, rows: PackDataset | ShardInterleaveDataset, *, batch_size: int,
               capacities: Capacities, identity: envelope.StreamIdentity,
               rebuild: Rebuild | None = None):
    super().__init__(rows)
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    self.batch_size = batch_size
    self.capacities = capacities
    self.identity = identity
    self.rebuild = rebuild

  def __iter__(self) -> BatchIterator:
    return BatchIterator(self._parent.__iter__(), batch_size=self.batch_size,
                         capacities=self.capacities, identity=self.identity,
                         rebuild=self.rebuild)

  def __str__(self) -> str:
    return f"BatchDataset(batch_size={self.batch_size})"

  def mp_prefetch(self, *args, **kwargs) -> NoReturn:
    raise UnsupportedOperationError(
        "the packed stream cannot run under Grain's mp_prefetch: the packer's state lives in "
        "one process. For decoding in worker processes pass `workers=N` to build_pipeline "
        "(or set `num_workers` in the config); the stream stays the same for any N.")

  def batch(self, *args, **kwargs) -> NoReturn:
    raise UnsupportedOperationError(
        "the packed stream is already batched, into static shapes: pass `batch_size=` to "
        "build_pipeline (or set `batch_size` in the config) instead of calling .batch().")

  def __getitem__(self, index) -> NoReturn:
    raise UnsupportedOperationError(
        f"the packed stream has no random access (ds[{index!r}]; also grain.DataLoader's "
        "data_source): each row depends on every draw before it. Iterate it instead, e.g. "
        "`itertools.islice(iter(ds), 3)`, and use get_state()/set_state() to come back to a "
        "position.")


class BatchIterator(StageIterator):
  """Batches of rows from a `PackIterator` or a `ShardInterleaveIterator`; `stats()` reports
  the pipeline's counters."""

  def __init__(self, rows: PackIterator | ShardInterleaveIterator, *, batch_size: int,
               capacities: Capacities, identity: envelope.StreamIdentity,
               rebuild: Rebuild | None = None):
    super().__init__(rows)
    self._rows = rows
    self._batch_size = batch_size
    self._capacities = capacities
    self._identity = identity
    self._rebuild = rebuild
    self._eras: era_keys.Plan = {}  # the groups' earlier record sets, when records were appended
    self._step = threading.Lock()  # one next() or set_state() at a time
    self._position_lock = threading.Lock()  # guards `_in_flight` and each change of position
    # The position a next() in progress started at.
    self._in_flight: PackPosition | InterleavePosition | None = None
    self._buffers = BatchBuffers(capacities, batch_size)
    # CPU seconds of the caller's thread spent writing rows, and taking and handing out
    # buffers (the rest of its time in next(): mixing, packing, waiting for samples).
    self._cpu = {"row_writing": 0.0, "hand_off": 0.0}

  def __next__(self) -> PackedBatch:
    self._assert_not_closed()
    with self._step:
      self._assert_not_closed()
      start = self._rows.position()
      with self._position_lock:
        self._in_flight = start
      try:
        return self._stats.record_output_spec(self._own_time(self._next_batch))
      except StopIteration:
        raise  # the stream's end: what was drawn on the way (drops, say) is counted
      except BaseException:
        with interrupts_held(), self._position_lock:
          self._rows.restore(start)
        raise
      finally:
        self._rows.forget_drawn()  # a batch made (or put back): its samples are not held
        with self._position_lock:
          self._in_flight = None

  def _at(self) -> tuple[PackIterator | ShardInterleaveIterator, era_keys.Plan,
                         PackPosition | InterleavePosition]:
    """(the rows, their record sets, the position of the last batch returned), read together:
    a consistent triple whatever runs meanwhile (a next(); a restore over records appended,
    which swaps the rows and sets)."""
    with self._position_lock:
      position = self._rows.position() if self._in_flight is None else self._in_flight
      return self._rows, self._eras, position

  def _next_batch(self) -> PackedBatch:
    began = time.thread_time()
    fetcher = getattr(self._rows, "fetcher", None)
    if getattr(fetcher, "workers", 0):  # pixels copied by the workers that hold them
      self._buffers.share(fetcher.make_arena)
    buffer = self._buffers.take()  # dropped, not reused, if this raises before hand_out
    copies = (fetcher.batch_copies(self._buffers.arena, buffer.slot)
              if buffer.slot is not None and getattr(fetcher, "workers", 0) else None)
    self._cpu["hand_off"] += time.thread_time() - began
    keys = []
    for b in range(self._batch_size):
      members = self._waiting(next, self._rows, None)
      if members is None:
        if b == 0:
          raise StopIteration
        break  # a finite stream's last batch: the remaining rows are empty
      self._write(buffer, b, [s.layout for s in members], copies)
      keys.append(self._keys(members))
    for b in range(len(keys), self._batch_size):
      self._write(buffer, b, [], copies)
    if copies is not None:
      began = time.thread_time()
      copies.finish()  # the workers' copies sent, each acknowledged
      self._cpu["row_writing"] += time.thread_time() - began
    began = time.thread_time()
    batch = self._buffers.hand_out(buffer)
    batch["sample_keys"] = keys + [()] * (self._batch_size - len(keys))
    self._cpu["hand_off"] += time.thread_time() - began
    return batch

  @property
  def batch_size(self) -> int:
    """Rows per batch."""
    return self._batch_size

  def _write(self, buffer, b: int, layouts, copies: Any) -> None:
    """Writes row `b`; `copies` (the fetcher's `batch_copies`, or None) takes its pixel copies."""
    began = time.thread_time()
    buffer.extents[b] = write_row(batch_row(buffer.arrays, b), layouts,
                                  previous=buffer.extents[b],
                                  **({} if copies is None else {"copy": copies.copy}))
    self._cpu["row_writing"] += time.thread_time() - began

  def close(self) -> None:
    """Closes the stages (their workers, threads) and lets go of the batch buffers."""
    super().close()
    with self._step:
      self._buffers.close()

  def cpu_seconds(self) -> dict[str, float]:
    """CPU seconds of the calling thread so far in writing rows ("row_writing") and in taking
    and handing out batch buffers ("hand_off"): the parts of the main process's work per
    row that are not mixing and packing (the bench's split)."""
    return dict(self._cpu)

  def buffer_stats(self) -> dict[str, int]:
    """The batch buffers: pooled (and their bytes), held by the caller, reused, allocated."""
    with self._step:
      return self._buffers.stats()

  def _keys(self, members: Sequence[PreparedSample]) -> SampleKeys:
    names = self._rows.group_names
    return tuple((names[s.key.group], s.key.index, s.key.epoch, s.key.record) for s in members)

  def get_state(self) -> dict[str, Any]:
    rows, eras, position = self._at()
    state = rows.state_of(position)
    if eras:
      common, per_shard = era_keys.state_keys(
          eras, {s: {name: [start.epoch for start in e.starts[s]]
                     for name, e in eras.items()} for s in rows.shards})
      state = {**state, era_keys.DATA_ERAS: common, "shards": {
          key: {**entry, era_keys.ERAS: per_shard[int(key)]}
          for key, entry in state["shards"].items()}}
    return envelope.sealed(state, self._identity.fingerprint)

  def set_state(self, state: dict[str, Any], *, allow_changes: bool = False,
                saved_manifests: Mapping[str, Mapping[str, Manifest]] | None = None,
                saved_eras: era_keys.Sets | None = None) -> None:
    """Continues from `state`, all checked first: a malformed or foreign one is a
    StateMismatchError naming the field, and the iterator stays where it was.

    `allow_changes`: continue across the changes a new stage of training makes
    (weights, groups added or removed at the end, records appended;
    `packing.continuation`), never across records removed or rewritten.
    `saved_manifests` (a checkpoint keeps them): the data the state was saved on, so
    that a refusal names the files that changed, and records appended can be told
    from the records before; `saved_eras` (`era_manifests()`, kept too): the files of
    the groups' earlier record sets.
    """
    with self._step:
      stages = envelope.opened(state, self._identity, allow_changes=allow_changes,
                               saved_manifests=saved_manifests)
      eras = self._eras_of(stages, saved_manifests, saved_eras)
      rows = self._rows
      if eras != self._eras:  # other record sets: rows built on them, the old kept on error
        if self._rebuild is None or not isinstance(rows, ShardInterleaveIterator):
          raise StateMismatchError("this iterator cannot continue over records appended: "
                                   "build it with build_pipeline")
        self._assert_not_closed()  # else the new rows' fetcher is one nothing closes
        dataset, resolved = self._rebuild(eras)
        rows = dataset.__iter__()
      try:
        position = rows.parse_state(stages)
      except BaseException:
        if rows is not self._rows:
          rows.close()
        raise
      if rows is self._rows:
        self._rows.forget_prefetched()
      else:
        eras = {name: era_keys.GroupEras(e.sets, {
            s: tuple(EraStart(epoch=n) for n in resolved[s][name]) for s in e.starts})
                for name, e in eras.items()}
      old = None
      with interrupts_held(), self._position_lock:
        if rows is not self._rows:
          old, self._rows, self._eras = self._rows, rows, eras
          self._parents = (rows,)
        self._rows.restore(position)
      if old is not None:  # once restored: an error closing it leaves the stream restored
        old.close()

  def _eras_of(self, stages: Mapping[str, Any],
               saved_manifests: Mapping[str, Mapping[str, Manifest]] | None,
               saved_eras: era_keys.Sets | None) -> era_keys.Plan:
    """The record sets `stages` goes on over (`packing.eras`)."""
    if era_keys.DATA_ERAS not in stages:
      return {}
    known: dict[str, list[Mapping[str, Manifest]]] = {}
    for source in (saved_eras or {}, {g: [m] for g, m in (saved_manifests or {}).items()},
                   era_keys.known_sets(self._eras)):
      for group, sets in source.items():
        known.setdefault(group, []).extend(sets)
    shards = stages.get("shards")
    served = getattr(self._rows, "shards", ())
    if not isinstance(shards, Mapping) or any(str(s) not in shards for s in served):
      return self._eras  # parsing names what is missing
    next_index = {}
    for shard in served:
      entry = shards[str(shard)]
      packer = entry.get("packer") if isinstance(entry, Mapping) else None
      indices = packer.get("next_index") if isinstance(packer, Mapping) else None
      next_index[shard] = indices if isinstance(indices, list) else []
    return era_keys.plan(stages, self._rows.group_names, known=known, next_index=next_index)

  def manifests(self) -> Mapping[str, Mapping[str, Manifest]]:
    """Per group and dataset, the data this stream reads (what a checkpoint keeps)."""
    return self._identity.manifests

  def era_manifests(self) -> era_keys.Sets:
    """Per group whose records were appended to at a restore, the files of each earlier
    record set (what a checkpoint keeps beside `manifests()`)."""
    return era_keys.known_sets(self._eras)

  def stats(self) -> dict[str, Any]:
    """The packer's counters (drawn, packed, dropped by reason, epochs); see PackIterator."""
    rows, _, position = self._at()
    return rows.stats(position)

  def __str__(self) -> str:
    return f"BatchIterator(batch_size={self._batch_size})"
