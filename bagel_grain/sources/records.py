"""A group's records in epoch-wise blocked shuffle order, one logical shard's share.

Element `i` of the resulting MapDataset is the record the stream sees i-th: its
index is the sample key Grain seeds the family's RNG with. Each epoch permutes
the source's blocks (parquet row groups; single lines for JSONL) and the rows
inside each block, so a pass reads every row group once.

A group whose records were appended to at a restore (docs/changes.md) has eras:
the epochs up to the one in progress cover the records it started with, later
ones the grown set. A shard's share of a grown set is its share of the set
before, plus its share of the records appended: a record never changes shard.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import sys
import threading
from typing import Any, Sequence

import grain
import numpy as np
import pyarrow as pa

from bagel_grain.drops import Drop, Dropped, DropReason
from bagel_grain.errors import DatasetError
from bagel_grain.sources.base import PartOffsets, RecordSource
from bagel_grain.storage import RetryPolicy, is_transient


@dataclasses.dataclass(frozen=True)
class Record:
  """One raw record and where it comes from; `error` set when it could not be read."""

  index: int
  epoch: int
  record_id: str
  dataset: int  # which of the group's datasets (for its data_dir)
  fields: Any = None
  error: Dropped | None = None


def location_free_id(record_id: str, dataset: str, roots: Sequence[str | None]) -> str:
  """`dataset/<path under its root>#row` (or `:line`) for a source's `record_id`: the same
  whether the dataset lies on a local disk or in a bucket, so keys of runs on copies join.

  `roots` are the folders a dataset's files may lie under (its `data_dir`, the folder of
  its JSONL); the longest that prefixes the id is cut, else the folders above the file.
  """
  best = max((r.rstrip("/") for r in roots if r and record_id.startswith(r.rstrip("/") + "/")),
             key=len, default=None)
  if best is None:
    path, sep, rest = _split_id(record_id)
    return f"{dataset}/{posixpath.basename(path.replace(os.sep, '/'))}{sep}{rest}"
  return f"{dataset}/{record_id[len(best) + 1:]}"


def _split_id(record_id: str) -> tuple[str, str, str]:
  """(file, separator, row or line) of `file#row` or `file:line`."""
  for sep in ("#", ":"):
    path, found, rest = record_id.rpartition(sep)
    if found and rest.isdigit():
      return path, sep, rest
  return record_id, "", ""


class ConcatSource:
  """Several datasets of one group, one after another; records know their dataset.

  A `RecordSource` itself, plus `locate`: which dataset an index falls in. Given
  `names` (and `roots`, per dataset the folders its files lie under), record ids
  are `name/<path under the root>`: independent of where the data lives
  (`location_free_id`).
  """

  def __init__(self, sources: Sequence[RecordSource], datasets: Sequence[int] | None = None,
               *, names: Sequence[str] | None = None,
               roots: Sequence[Sequence[str | None]] | None = None):
    self._sources = list(sources)
    self._datasets = list(range(len(self._sources)) if datasets is None else datasets)
    self._names, self._roots = names, roots  # by dataset number
    self._part_offsets: PartOffsets | None = None  # lengths load sources: asked for late

  @property
  def _offsets(self) -> PartOffsets:
    if self._part_offsets is None:
      self._part_offsets = PartOffsets([len(s) for s in self._sources])
    return self._part_offsets

  @property
  def sources(self) -> tuple[RecordSource, ...]:
    return tuple(self._sources)

  def __len__(self) -> int:
    return len(self._offsets)

  def num_blocks(self) -> int:
    return sum(s.num_blocks() for s in self._sources)

  def restrict(self, first: int, last: int) -> ConcatSource:
    """Blocks [first, last) of the datasets laid end to end; records keep their dataset."""
    if (first, last) == (0, self.num_blocks()):
      return self
    parts, datasets, start = [], [], 0
    for source, dataset in zip(self._sources, self._datasets):
      n = source.num_blocks()
      lo, hi = max(first - start, 0), min(last - start, n)
      if lo < hi:
        parts.append(source.restrict(lo, hi))
        datasets.append(dataset)
      start += n
    return ConcatSource(parts, datasets, names=self._names, roots=self._roots)

  def restrict_ranges(self, ranges: Sequence[tuple[int, int]]) -> ConcatSource:
    """The blocks of `ranges` ([first, last) each), in that order."""
    return joined_sources([self.restrict(first, last) for first, last in ranges if first < last],
                          like=self)

  def locate(self, index: int) -> tuple[int, int]:
    """(dataset number, index within that dataset)."""
    part, i = self._offsets.locate(index)
    return self._datasets[part], i

  def _part(self, index: int) -> tuple[RecordSource, int]:
    part, i = self._offsets.locate(index)
    return self._sources[part], i

  def block_sizes(self) -> np.ndarray:
    return np.concatenate([s.block_sizes() for s in self._sources]).astype(np.int64)

  def record_id(self, index: int) -> str:
    part, i = self._offsets.locate(index)
    record_id = self._sources[part].record_id(i)
    if self._names is None:
      return record_id
    dataset = self._datasets[part]
    return location_free_id(record_id, self._names[dataset],
                            self._roots[dataset] if self._roots else ())

  def __getitem__(self, index: int):
    source, i = self._part(index)
    return source[i]

  def where(self, index: int) -> str:
    """Where the record lies: its source's own id (`s3://bucket/vlm/sft.jsonl:12`)."""
    source, i = self._part(index)
    return source.record_id(i)

  def record_bytes(self, index: int) -> int | None:
    """The record's size in bytes when its source knows it unread (JSONL line offsets)."""
    source, i = self._part(index)
    size_of = getattr(source, "record_bytes", None)
    return None if size_of is None else size_of(i)


def joined_sources(parts: Sequence[ConcatSource], *, like: ConcatSource) -> ConcatSource:
  """`parts` (restrictions of `like`) end to end, as one source."""
  # pylint: disable=protected-access
  return ConcatSource([s for p in parts for s in p._sources],
                      [d for p in parts for d in p._datasets], names=like._names, roots=like._roots)


def block_share(num_blocks: int, shard_index: int, shard_count: int) -> tuple[int, int]:
  """Blocks [first, last) of one logical shard: `np.array_split`'s contiguous share, by
  arithmetic."""
  base, extra = divmod(num_blocks, shard_count)
  first = shard_index * base + min(shard_index, extra)
  return first, first + base + (shard_index < extra)


def shard_blocks(sizes: np.ndarray, shard_index: int,
                 shard_count: int) -> tuple[np.ndarray, np.ndarray]:
  """A contiguous, disjoint share of the blocks for one logical shard, as (starts, sizes).

  With fewer blocks than shards the blocks are split into single rows first,
  so that every shard still gets records.
  """
  sizes = np.asarray(sizes, np.int64)
  starts = np.cumsum(sizes) - sizes
  if len(sizes) < shard_count:
    starts, sizes = np.arange(int(sizes.sum()), dtype=np.int64), np.ones(int(sizes.sum()), np.int64)
  if len(sizes) < shard_count:
    raise DatasetError(f"{len(sizes)} records cannot be shared by {shard_count} logical shards "
                       "(one per process unless `logical_shards` is set)")
  share = np.array_split(np.arange(len(sizes)), shard_count)[shard_index]
  return starts[share], sizes[share]


@dataclasses.dataclass
class _Era:
  """One record set of a shard: its records (`source`, blocks at `starts` of `lens` rows,
  `lens` None when every block is one record at consecutive places from `starts`), and
  the epochs and elements it covers from `first_epoch` and `first_index` on."""

  source: ConcatSource
  starts: Any
  lens: np.ndarray | None
  per_epoch: int
  first_epoch: int = 0
  first_index: int = 0


def _era(source: ConcatSource, starts: np.ndarray, lens: np.ndarray) -> _Era:
  # One record per block at consecutive places (JSONL lines): the first place is all it
  # takes, and an epoch's order is a permutation of the places.
  per_epoch = int(lens.sum())
  if np.all(lens == 1) and np.all(np.diff(starts) == 1):
    return _Era(source, int(starts[0]) if len(starts) else 0, None, per_epoch)
  return _Era(source, starts, lens, per_epoch)


def _share(source: ConcatSource, shard_index: int, shard_count: int, *,
           may_be_empty: bool = False) -> tuple[ConcatSource, np.ndarray, np.ndarray]:
  """A shard's share of `source` as (source, block starts, block sizes): its contiguous
  blocks, restricted to; or, with fewer blocks than shards, rows one by one (an appended
  part may then leave a shard nothing)."""
  if source.num_blocks() >= shard_count:
    source = source.restrict(*block_share(source.num_blocks(), shard_index, shard_count))
    return (source, *shard_blocks(source.block_sizes(), 0, 1))
  if may_be_empty:
    rows = np.array_split(np.arange(len(source), dtype=np.int64), shard_count)[shard_index]
    return source, rows, np.ones(len(rows), np.int64)
  return (source, *shard_blocks(source.block_sizes(), shard_index, shard_count))


@dataclasses.dataclass(frozen=True)
class EraStart:
  """Where a grown record set starts in a shard: at `epoch`, or (`after`: a shard's next
  element index at the restore that appended) at the first epoch not yet begun there."""

  epoch: int | None = None
  after: int | None = None


class ShuffledRecords(grain.MapDataset):
  """One logical shard's records, reshuffled each epoch; endless when `num_epochs` is None.

  With at least one block per shard, the source is restricted to this shard's
  blocks before anything per record is loaded: rows are numbered from the share's
  first block, a constant shift that leaves the order (a permutation of blocks,
  then of rows inside each) exactly as on the whole source.

  `sets` (records appended at restores): the block ranges of `source` that made up
  the group before each append, oldest first; `starts` where each later set begins
  (one per set). Without them the source is one set from epoch 0.

  A read that fails for good (the file is gone, or damaged) gives a record carrying
  its drop; one that fails transiently is retried under `storage` and, past its
  deadline, raises `StorageUnavailableError` (nothing dropped).
  """

  def __init__(self, source: ConcatSource, *, seed: int, shard_index: int = 0,
               shard_count: int = 1, num_epochs: int | None = None,
               storage: RetryPolicy | None = None,
               sets: Sequence[Sequence[tuple[int, int]]] = (),
               starts: Sequence[EraStart] = ()):
    super().__init__()
    if len(sets) != len(starts):
      raise ValueError(f"{len(sets)} earlier record sets, {len(starts)} starts")
    self._storage = storage or RetryPolicy()
    ranges = [list(r) for r in sets] + [[(0, source.num_blocks())]]
    era = _era(*_share(source.restrict_ranges(ranges[0]) if sets else source, shard_index,
                       shard_count))
    if era.per_epoch == 0:
      raise DatasetError("the group has no records")
    self._eras = [era]
    for before, now, start in zip(ranges, ranges[1:], starts):
      added = source.restrict_ranges(_minus(now, before))
      part, rows, lens = _share(added, shard_index, shard_count, may_be_empty=True)
      prev = self._eras[-1]
      old_starts, old_lens = _blocks_of(prev)
      grown = _era(joined_sources([prev.source, part], like=source),
                   np.concatenate([old_starts, rows + len(prev.source)]).astype(np.int64),
                   np.concatenate([old_lens, lens]).astype(np.int64))
      grown.first_epoch = (start.epoch if start.epoch is not None else prev.first_epoch + max(
          0, -(-(start.after - prev.first_index) // prev.per_epoch)))
      if grown.first_epoch < prev.first_epoch:
        raise DatasetError(f"a record set starts at epoch {grown.first_epoch}, before the "
                           f"one it grew from ({prev.first_epoch})")
      grown.first_index = prev.first_index + (grown.first_epoch - prev.first_epoch) * prev.per_epoch
      self._eras.append(grown)
    self._source = self._eras[0].source  # the first set's: what a group of one set reads
    self._per_epoch = self._eras[0].per_epoch
    self._seed = seed
    self._shard_index = shard_index
    self._num_epochs = num_epochs
    self._orders: dict[tuple[int, int], np.ndarray] = {}
    self._lock = threading.Lock()

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_orders"], state["_lock"] = {}, None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  @property
  def records_per_epoch(self) -> int:
    """Records per epoch of the first set (the only one, unless records were appended)."""
    return self._per_epoch

  @property
  def blocks_per_epoch(self) -> int:
    """Blocks (row groups, or single records) per epoch of the first set."""
    era = self._eras[0]
    return era.per_epoch if era.lens is None else len(era.lens)

  def era_starts(self) -> list[int]:
    """The first epoch of each later record set in this shard."""
    return [e.first_epoch for e in self._eras[1:]]

  def later_eras(self) -> tuple[tuple[int, int, int], ...]:
    """(first element, first epoch, records per epoch) of each later record set."""
    return tuple((e.first_index, e.first_epoch, e.per_epoch) for e in self._eras[1:])

  def __len__(self) -> int:
    if self._num_epochs is None:
      return sys.maxsize
    last = self._eras[self._last_era()]
    return last.first_index + (self._num_epochs - last.first_epoch) * last.per_epoch

  def _last_era(self) -> int:
    """The last era that starts within `num_epochs`."""
    n = 0
    while (n + 1 < len(self._eras) and (
        self._num_epochs is None or self._eras[n + 1].first_epoch < self._num_epochs)):
      n += 1
    return n

  def __str__(self) -> str:
    return f"ShuffledRecords(records_per_epoch={self._per_epoch}, epochs={self._num_epochs})"

  def _order(self, era: int, epoch: int) -> np.ndarray:
    with self._lock:
      order = self._orders.get((era, epoch))
    if order is not None:
      return order
    e = self._eras[era]
    rng = np.random.default_rng([self._seed, self._shard_index, epoch])
    if e.lens is None:  # what the general case gives for blocks of one record
      return self._keep(era, epoch, rng.permutation(e.per_epoch) + e.starts)
    blocks = rng.permutation(len(e.starts))
    lens = e.lens[blocks]
    block_of_row = np.repeat(np.arange(len(blocks)), lens)
    first_row = np.repeat(np.cumsum(lens) - lens, lens)
    rows = np.repeat(e.starts[blocks], lens) + np.arange(len(block_of_row)) - first_row
    # Rows keep their block's place; inside a block they are ordered by a random key.
    return self._keep(era, epoch, rows[np.lexsort((rng.random(len(rows)), block_of_row))])

  def _keep(self, era: int, epoch: int, order: np.ndarray) -> np.ndarray:
    """Keeps an epoch's order (4 bytes a record below 2**31 records), and the one before it
    (a reader may still be in it)."""
    if order.max() < 2**31:
      order = order.astype(np.int32)
    with self._lock:
      self._orders[(era, epoch)] = order
      for old in [k for k in self._orders if k[1] < epoch - 1]:
        del self._orders[old]
    return order

  def _source_index(self, index: int) -> tuple[int, int, ConcatSource]:
    """(epoch, index in the source, the source) of element `index`."""
    if not 0 <= index < len(self):
      raise IndexError(index)
    era = len(self._eras) - 1
    while self._eras[era].first_index > index:
      era -= 1
    e = self._eras[era]
    epoch, position = divmod(index - e.first_index, e.per_epoch)
    return e.first_epoch + epoch, int(self._order(era, e.first_epoch + epoch)[position]), e.source

  def record_id(self, index: int) -> str:
    """The id of element `index`'s record, without reading it (for error messages)."""
    _, i, source = self._source_index(index)
    return source.record_id(i)

  def record_bytes(self, index: int) -> int | None:
    """Element `index`'s size in bytes if known before reading it (for read-ahead's bound)."""
    _, i, source = self._source_index(index)
    return source.record_bytes(i)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, source_index, source = self._source_index(index)
    dataset, _ = source.locate(source_index)
    record_id = source.record_id(source_index)
    try:
      fields = self._storage.call(f"record {source.where(source_index)}",
                                  lambda: source[source_index])
    except (OSError, pa.ArrowException) as e:  # a file that became unreadable mid-run
      if is_transient(e):  # a read ahead, which tries once: the consumer reads again
        raise
      return Record(index, epoch, record_id, dataset,
                    error=Dropped(DropReason.UNREADABLE_FILE, str(e)))
    except Drop as e:  # the source's verdict on this one record
      return Record(index, epoch, record_id, dataset, error=e.dropped)
    return Record(index, epoch, record_id, dataset, fields)


def _blocks_of(era: _Era) -> tuple[np.ndarray, np.ndarray]:
  """An era's blocks as (starts, sizes) arrays."""
  if era.lens is None:
    return (np.arange(era.starts, era.starts + era.per_epoch, dtype=np.int64),
            np.ones(era.per_epoch, np.int64))
  return np.asarray(era.starts, np.int64), np.asarray(era.lens, np.int64)


def _minus(now: Sequence[tuple[int, int]], before: Sequence[tuple[int, int]]
           ) -> list[tuple[int, int]]:
  """The blocks of `now` not in `before` (a set grown by appends; both in ascending
  order), as ascending ranges."""
  size = max([b for _, b in now] + [0])
  kept = np.zeros(size + 2, np.int8)  # one place on each side, so every run has two edges
  for first, last in now:
    kept[first + 1:last + 1] = 1
  for first, last in before:
    kept[first + 1:last + 1] = 0
  edges = np.flatnonzero(np.diff(kept))
  return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def dataset_roots(dataset: Any) -> list[str | None]:
  """The folders a dataset's record files lie under (a `config.DatasetSpec`): its
  `data_dir`, and the folder of its JSONL or array_record file(s)."""
  from bagel_grain import fs  # pylint: disable=import-outside-toplevel
  roots = [dataset.data_dir]
  for path in (dataset.jsonl_path, dataset.array_record_path):
    if path:
      roots += [path, fs.dirname(path)]
  return roots
