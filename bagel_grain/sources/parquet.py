"""Random access to parquet rows, indexed from the sidecar index or the footers (no data scan).

Decoded row groups are kept as Arrow tables (one copy of their bytes) in a cache
bounded in bytes; a row becomes Python values only when it is asked for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import threading
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow._parquet import ParquetReader  # pylint: disable=no-name-in-module

from bagel_grain import fs, held_memory, io_limits
from bagel_grain.drops import Drop, DropReason
from bagel_grain.errors import DatasetError
from bagel_grain.sources.base import PartOffsets
from bagel_grain.sources import parquet_footer, sidecar

# Per source and process. Rows come in row-group-blocked order, so a reader needs the row
# group it is in and the next one, which read-ahead starts early: two row groups of 16 MiB.
# A larger cache only keeps what a pass has left behind (in every worker process too).
DEFAULT_CACHE_BYTES = 32 << 20
_BATCH_BYTES = 1 << 20  # a row group is decoded this much at a time
_UNDECODABLE_KEPT = 256


@functools.cache
def _memory_pool() -> pa.MemoryPool:
  """The pool row groups are decoded into: Arrow's jemalloc pool where pyarrow has it.

  Row groups are decoded on read-ahead threads and freed on others. pyarrow's default
  pool (mimalloc) kept what they freed in each thread's heap: the main process grew by
  about 300 MiB over 500 batches of the bench config, with 50 MiB of Arrow memory in use;
  jemalloc gives it back. Passed to each read (`ParquetReader(memory_pool=)`), so the
  host's own default pool is never changed; `ARROW_DEFAULT_MEMORY_POOL` set by the host
  is obeyed.
  """
  if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
    return pa.default_memory_pool()
  try:
    return pa.jemalloc_memory_pool()
  except NotImplementedError:
    return pa.default_memory_pool()  # a pyarrow built without jemalloc


def _give_back_freed() -> None:
  """After a row group's read: the pool's freed pages go back to the kernel now.

  A read frees about as much as it keeps (the column chunk's dictionary, which Arrow's
  decoder copies whole, and the row groups the cache let go), and jemalloc keeps freed
  pages until they have aged: beside the next reads of the other datasets and the
  decoded images, that made a row group more of the process's peak. One purge per row
  group read (a few `madvise` calls). Our own pool only: a pool the host chose
  (`ARROW_DEFAULT_MEMORY_POOL`) is the host's to manage."""
  pool = _purged_pool()
  if pool is not None:
    pool.release_unused()


@functools.cache
def _purged_pool() -> pa.MemoryPool | None:
  """The pool `_give_back_freed` purges: ours, None where the host chose one (asked once)."""
  return None if os.environ.get("ARROW_DEFAULT_MEMORY_POOL") else _memory_pool()


class _RowGroupGone(Exception):
  """The row group indexed at build time is not in the file any more (it was rewritten)."""


class _RowGroupCache:
  """An LRU of decoded row groups (Arrow tables), shared by the parts `restrict` cuts from
  one source (the logical shards of a process): at most `max_bytes` of them, but always
  the latest one per reader, so each shard keeps the row group it is in. A pickled copy
  (a worker's) starts empty; parts pickled together share it there too."""

  def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, readers: int = 1):
    self.max_bytes, self.readers = max_bytes, readers
    self.held_bytes = 0
    self._groups: collections.OrderedDict[tuple[str, int], pa.Table] = collections.OrderedDict()
    self._lock = threading.Lock()
    held_memory.register(self, held_memory.ROW_GROUP_CACHE, lambda cache: cache.held_bytes)

  def __getstate__(self):
    return {"max_bytes": self.max_bytes, "readers": self.readers}

  def __setstate__(self, state):
    self.__init__(state["max_bytes"], state["readers"])

  def get(self, key) -> pa.Table | None:
    with self._lock:
      if key in self._groups:
        self._groups.move_to_end(key)
        return self._groups[key]
    return None

  def make_room(self, incoming: int) -> None:
    """Before a read: lets go of what would not stay beside `incoming` more bytes, so the
    old row groups are not held while the new one decodes."""
    with self._lock:
      self._evict(incoming, keep=self.readers - 1)

  def put(self, key, table: pa.Table) -> None:
    with self._lock:
      if key not in self._groups:
        self._groups[key] = table
        self.held_bytes += table.nbytes
      self._evict(0, keep=self.readers)

  def _evict(self, incoming: int, keep: int) -> None:
    while len(self._groups) > keep and self.held_bytes + incoming > self.max_bytes:
      _, old = self._groups.popitem(last=False)
      self.held_bytes -= old.nbytes


class ParquetCatalog:
  """What a build knows about a dataset's parquet files before reading any row.

  Per file (repeats allowed, upstream's `num_used_data`): its facts (columns and
  row-group sizes) from the sidecar index or its footer, or only its row-group
  count from upstream's `parquet_info`; footers are then read only for the files
  whose blocks a process takes (`blocks`). Blocks are the non-empty row groups,
  file by file: the units the order layer shuffles.
  """

  def __init__(self, files: Sequence[str], columns: Sequence[str], *,
               facts: dict[str, sidecar.ParquetFileFacts] | None = None,
               counts: dict[str, int] | None = None, counts_file: str | None = None,
               listed: Sequence[tuple[str, int]] = (),
               pins: dict[str, fs.FileInfo] | None = None):
    self.files, self.columns = list(files), list(columns)
    self.listed = tuple(listed)  # (name, size) of the folder's files, as the build listed them
    # file path -> the content checksum its sidecar index records (the manifest's)
    self.checksums = {path: f.identity.checksum() for path, f in (facts or {}).items()
                      if f.identity is not None and f.identity.checksum()}
    self.pins = dict(pins or {})  # file path -> its listing: what every read must find
    self._facts = dict(facts or {})
    self._counts, self._counts_file = dict(counts or {}), counts_file
    missing = sorted({f for f in self.files if f not in self._facts and f not in self._counts})
    self._read_footers(missing)
    per_file = {f: (int(np.count_nonzero(self._facts[f].row_group_rows)) if f in self._facts
                    else self._counts[f]) for f in set(self.files)}
    self._file_blocks = PartOffsets([per_file[f] for f in self.files])

  def _read_footers(self, paths: Sequence[str]) -> None:
    """Reads the footers of `paths`, and probes the local ones for their pins
    (`_probe_pins`)."""
    with concurrent.futures.ThreadPoolExecutor(io_limits.FOOTER_THREADS) as pool:
      self._probe_pins(pool, paths)
      for path, meta in zip(paths, pool.map(
          lambda p: parquet_footer.read(p, self.pins.get(p), at_build=True),
          paths)):
        facts = sidecar.ParquetFileFacts.of_footer(meta)
        if path in self._counts and (self._counts[path] != len(facts.row_group_rows)
                                     or not np.all(facts.row_group_rows)):
          raise DatasetError(
              f"parquet_info says {self._counts[path]} row groups for {path}; its footer has "
              f"{len(facts.row_group_rows)} ({int(np.count_nonzero(facts.row_group_rows))} "
              "non-empty). Fix parquet_info, or run `bagel-grain index CONFIG` and drop it",
              file=self._counts_file, field="parquet_info_path")
        self._facts[path] = facts
    for path in paths:
      names = self._facts[path].columns
      for column in self.columns:
        if column not in names:
          raise DatasetError(f"parquet file lacks column {column!r}; it has {sorted(names)}",
                             file=path, field=column)

  def _probe_pins(self, pool, paths: Sequence[str]) -> None:
    """A local file's pin carries its footer's probe (the index's, or read now with its
    footer), so a file whose time alone changes mid-run (a `touch`, an identical file
    uploaded again under a mount) is still read; a rewrite is still refused. Updated in
    place: the sources built on this catalog share the dict."""
    local = [p for p in paths if p in self.pins and not fs.is_uri(p)]
    for path, pin in zip(local, pool.map(lambda p: fs.with_probe(self.pins[p], "parquet"),
                                         local)):
      self.pins[path] = pin

  @property
  def num_blocks(self) -> int:
    return len(self._file_blocks)

  def file_block_counts(self) -> np.ndarray:
    """The blocks of each file, in order."""
    return self._file_blocks.sizes

  def blocks(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                   np.ndarray]:
    """Blocks [first, last) as arrays: file number, row group, rows, first row in the file."""
    if first >= last:
      empty = np.zeros(0, np.int64)
      return empty, empty, empty, empty
    lo = self._file_blocks.locate(first)[0]
    hi = self._file_blocks.locate(last - 1)[0] + 1
    self._read_footers(sorted({f for f in self.files[lo:hi] if f not in self._facts}))
    file_no, rg, rows, file_row = [], [], [], []
    for number in range(lo, hi):
      sizes = self._facts[self.files[number]].row_group_rows
      kept = np.flatnonzero(sizes)
      file_no.append(np.full(len(kept), number, np.int64))
      rg.append(kept)
      rows.append(sizes[kept])
      file_row.append((np.cumsum(sizes) - sizes)[kept])
    skip = first - int(self._file_blocks.starts[lo])
    cut = slice(skip, skip + last - first)
    return tuple(np.concatenate(a).astype(np.int64)[cut] for a in (file_no, rg, rows, file_row))


def dataset_catalog(data_dir: str, num_used: int | None, columns: Sequence[str],
                    parquet_info_path: str | None = None) -> ParquetCatalog:
  """The dataset's catalog: from the sidecar index when there is one, else from
  `parquet_info` (counts) and footers. The folder is listed either way: its files
  are the dataset, and their sizes and times tell a stale index."""
  everything = fs.list_file_infos(data_dir)  # the index's presence too: no request to ask
  listed = [i for i in everything if i.base_name.endswith(".parquet")]
  if not listed:
    raise DatasetError("no .parquet files in data_dir", file=data_dir, field="data_dir")
  files = [fs.join(data_dir, i.base_name) for i in listed]
  pins = dict(zip(files, listed))
  if num_used is not None:
    files = [files[i % len(files)] for i in range(num_used)]
  names = [(i.base_name, int(i.size)) for i in listed]  # the manifest's: no second listing
  facts = sidecar.read_parquet_index(
      data_dir, listed, present=any(i.base_name == sidecar.PARQUET_INDEX for i in everything))
  # Footers read at build: a small dataset in a bucket is read whole in their place.
  if facts is None:
    parquet_footer.read_whole(listed)
  else:
    for path, pin in pins.items():  # the index's probe: what a file whose time changes is
      if not fs.is_uri(path) and facts[path].identity.probe:
        pins[path] = dataclasses.replace(pin, probe=("parquet", facts[path].identity.probe))
    for info in listed:  # the index's counts size the order as a footer's would
      path = fs.join(data_dir, info.base_name)
      parquet_footer.check_indexed_rows(facts[path].row_group_rows, int(info.size), path,
                                        fs.join(data_dir, sidecar.PARQUET_INDEX))
    return ParquetCatalog(files, columns, facts=facts, listed=names, pins=pins)
  if parquet_info_path is not None:
    with concurrent.futures.ThreadPoolExecutor(io_limits.FOOTER_THREADS + 1) as pool:
      info = pool.submit(sidecar.read_parquet_info, parquet_info_path)
      _footers_ahead(pool, files, pins)
      counts = sidecar.row_group_counts(files, info.result())
    return ParquetCatalog(files, columns, counts=counts, counts_file=parquet_info_path,
                          listed=names, pins=pins)
  return ParquetCatalog(files, columns, listed=names, pins=pins)


def _footers_ahead(pool, files: Sequence[str], pins: dict[str, fs.FileInfo]) -> None:
  """On a bucket, the footers of the first files (at most `FOOTER_THREADS`), read while
  `parquet_info` is and kept (`parquet_footer.keep`): a single process's blocks need them
  next, one round trip later; a process whose share lies elsewhere spends requests of a
  round trip it waits on anyway. A failure is left to the read that needs the footer."""
  ahead = [f for f in dict.fromkeys(files) if fs.is_uri(f)][:io_limits.FOOTER_THREADS]

  def read(path: str) -> None:
    try:
      parquet_footer.read(path, pins.get(path), at_build=True)
    except (DatasetError, OSError):
      pass

  for path in ahead:
    pool.submit(read, path)


class ParquetRowSource:
  """Rows of a list of parquet files (repeats allowed), as dicts of `columns`.

  Index order is file by file, row group by row group; `block_sizes()` gives the
  row groups' sizes so the order layer can shuffle them as units and read
  each row group once per pass. An LRU of decoded row groups, at most `cache_bytes`
  of them (see `_RowGroupCache`), serves the rows.
  `restrict(first, last)` keeps blocks [first, last) only: a logical shard holds
  (and reads footers for) its own share. `readers`: how many logical shards of a
  process read parts of it at once; the parts share one cache with a row group in
  hand for each. `max_cell_bytes`: a row with a binary cell (an image) larger than
  this is dropped as `file_too_large` (see `_drop_oversized_cells`).
  """

  def __init__(self, files: Sequence[str], columns: Sequence[str], *,
               catalog: ParquetCatalog | None = None, blocks: tuple[int, int] | None = None,
               readers: int = 1, cache_bytes: int = DEFAULT_CACHE_BYTES,
               cache: _RowGroupCache | None = None, max_cell_bytes: int | None = None):
    self._catalog = catalog or ParquetCatalog(files, columns)
    self._pins = self._catalog.pins  # reads are of the files the build listed, or dropped
    self.listed = self._catalog.listed  # (name, size) per file of the folder, when listed
    self.checksums = self._catalog.checksums  # path -> its indexed content checksum
    self._files = list(files)
    self._columns = list(columns)
    self._max_cell_bytes = max_cell_bytes
    self._range = blocks or (0, self._catalog.num_blocks)
    self._built = False
    self._cache = cache or _RowGroupCache(cache_bytes, readers)
    self._lock = threading.Lock()
    self._loading: dict[tuple[str, int], threading.Lock] = {}
    # Row groups Arrow could not decode: {(file, row group): why}, a few per process.
    self._undecodable: dict[tuple[str, int], str] = {}
    self.row_group_reads = 0
    self.bytes_read = 0  # decoded row-group bytes, against bytes_served: the cost of blocking
    self.bytes_served = 0

  def num_blocks(self) -> int:
    return self._range[1] - self._range[0]

  def restrict(self, first: int, last: int) -> ParquetRowSource:
    if (first, last) == (0, self.num_blocks()):
      return self
    start = self._range[0]
    blocks = (start + first, start + last)
    if not self._built:
      return ParquetRowSource(self._files, self._columns, catalog=self._catalog, blocks=blocks,
                              cache=self._cache, max_cell_bytes=self._max_cell_bytes)
    part = ParquetRowSource.__new__(ParquetRowSource)  # the catalog is gone: cut the arrays
    part.__setstate__({**self.__getstate__(), "_range": blocks})
    arrays = (self._block_file, self._block_rg, self._blocks.sizes, self._block_file_row)
    part._set_blocks(*(a[first:last] for a in arrays))
    return part

  def file_blocks(self) -> list[tuple[str, int]]:
    """(file, blocks) of each of the files, in order (of a source not restricted)."""
    if self._catalog is not None:
      counts = self._catalog.file_block_counts()
    else:
      counts = np.bincount(self._block_file, minlength=len(self._files))
    return [(f, int(n)) for f, n in zip(self._files, counts)]

  def _build(self) -> None:
    if not self._built:
      self._set_blocks(*self._catalog.blocks(*self._range))

  def _set_blocks(self, block_file, block_rg, sizes, file_row) -> None:
    self._block_file, self._block_rg, self._block_file_row = block_file, block_rg, file_row
    held = {self._files[i] for i in np.unique(block_file)}
    self._pins = {f: pin for f, pin in self._pins.items() if f in held}
    self._blocks = PartOffsets(sizes)
    self._catalog = None  # what this source needs is in its arrays now
    self._built = True

  def __getstate__(self):
    self._build()  # workers get the arrays, never the catalog
    state = self.__dict__.copy()
    state["_lock"], state["_loading"], state["_undecodable"] = None, {}, {}
    # The objects the build read whole: every process reads the bytes the build saw.
    state["_held"] = {path: data for path, pin in self._pins.items()
                      if (data := parquet_footer.held(pin)) is not None}
    return state

  def __setstate__(self, state):
    held = state.pop("_held", {})
    self.__dict__.update(state)
    self._lock = threading.Lock()
    for path, data in held.items():
      parquet_footer.hold(self._pins[path], data)

  def __len__(self) -> int:
    self._build()
    return len(self._blocks)

  def block_sizes(self) -> np.ndarray:
    self._build()
    return self._blocks.sizes

  def record_id(self, index: int) -> str:
    self._build()
    block, row = self._blocks.locate(index)
    return f"{self._files[self._block_file[block]]}#{int(self._block_file_row[block]) + row}"

  def _row_group(self, block: int) -> pa.Table:
    key = (self._files[self._block_file[block]], int(self._block_rg[block]))
    with self._lock:
      loading = self._loading.setdefault(key, threading.Lock())
    with loading:  # one read per row group, however many threads (read-ahead) want it
      table = self._cache.get(key)
      if table is not None:
        return table
      if key in self._undecodable:  # its other rows: dropped without reading it again
        raise Drop(DropReason.UNREADABLE_FILE, self._undecodable[key])
      try:
        table = self._read(key[0], key[1], int(self._blocks.sizes[block]))
        with self._lock:
          self.row_group_reads += 1
          self.bytes_read += table.nbytes
        self._cache.put(key, table)
      except fs.ObjectChanged:
        raise Drop(DropReason.UNREADABLE_FILE, f"{key[0]} changed since the stream was built: "
                   "its rows are not read") from None
      except (pa.ArrowException, _RowGroupGone) as e:
        if isinstance(e, OSError):
          raise  # an I/O error: the caller decides whether it lasts
        # Arrow's verdict on the bytes (a row group the file no longer has, a damaged page)
        detail = f"{key[0]} row group {key[1]}: {e}"
        with self._lock:
          if len(self._undecodable) >= _UNDECODABLE_KEPT:
            self._undecodable.clear()
          self._undecodable[key] = detail
        raise Drop(DropReason.UNREADABLE_FILE, detail) from None
      finally:
        with self._lock:
          self._loading.pop(key, None)
    _give_back_freed()  # a thread waiting for this row group does not wait for the purge
    return table

  def _read(self, path: str, row_group: int, rows: int) -> pa.Table:
    """One row group, decoded a batch of about `_BATCH_BYTES` at a time from a buffered stream.

    Reading it whole loads its column chunks first, then grows each column's buffers
    by doubling: Arrow's peak is about 4 times the row group, against under 3 this
    way (a binary column pyarrow wrote dictionary-first still decodes that page whole).
    """
    pin = self._pins.get(path)
    meta = self._footer(path, pin)
    wanted = set(self._columns)  # a nested column is read through its leaves
    whole = parquet_footer.held(pin) if fs.is_uri(path) else None  # read whole at build
    span = None if meta is None or whole is not None or not fs.is_uri(path) else _chunk_span(
        meta, row_group, wanted)
    with (pa.BufferReader(whole) if whole is not None
          else fs.open_random_access(path, pin=pin, span=span)) as f:
      # pyarrow's ParquetFile takes no pool: its reader does (the class ParquetFile wraps).
      parquet = ParquetReader(memory_pool=_memory_pool())
      parquet.open(f, buffer_size=_BATCH_BYTES, pre_buffer=False, metadata=meta)
      if row_group >= parquet.metadata.num_row_groups:  # the footer in hand, kept or read
        raise _RowGroupGone(f"the file has {parquet.metadata.num_row_groups} row groups now")
      nbytes = parquet.metadata.row_group(row_group).total_byte_size  # uncompressed
      self._cache.make_room(nbytes)
      batch_rows = max(1, min(rows, _BATCH_BYTES * rows // max(1, nbytes)))
      columns = [i for i, leaf in enumerate(parquet.column_paths) if leaf[0] in wanted]
      batches = parquet.iter_batches(batch_rows, [row_group], columns, use_threads=False)
      if self._max_cell_bytes is None:
        return pa.Table.from_batches(list(batches))
      return _drop_oversized_cells(batches, self._max_cell_bytes)

  @staticmethod
  def _footer(path: str, pin: fs.FileInfo | None):
    """The footer of the content `pin` saw: the one this process read last (the build's),
    else, for an object, read now (a request of its own, kept for the next row groups),
    so that the row group's column chunks are read together (`_chunk_span`). None for a
    local file not read yet: its reader reads it."""
    if pin is None or not fs.is_uri(path):
      return parquet_footer.known(pin)
    return parquet_footer.read(path, pin, at_build=False)

  def __getitem__(self, index: int) -> dict[str, Any]:
    self._build()
    block, row = self._blocks.locate(index)
    table = self._row_group(block)
    if row >= table.num_rows:  # what was indexed is not there: rewritten, or a lying footer
      raise Drop(DropReason.UNREADABLE_FILE, (
          f"{self._files[self._block_file[block]]} row group {int(self._block_rg[block])} "
          f"holds {table.num_rows} rows, {int(self._blocks.sizes[block])} were indexed: the "
          "file changed since, or its footer lies"))
    if table.schema.metadata and _OVERSIZED in table.schema.metadata:
      detail = json.loads(table.schema.metadata[_OVERSIZED]).get(str(row))
      if detail is not None:
        raise Drop(DropReason.FILE_TOO_LARGE, f"{self.record_id(index)}: {detail}")
    fields = {name: table.column(name)[row].as_py() for name in self._columns}
    self.bytes_served += sum(_nbytes(v) for v in fields.values())
    return fields


# A row group's column chunks are read as one request when the bytes from the first to the
# last of those read are at most this many (held until the row group is decoded); a larger
# one is read as its reader asks, a buffer at a time.
SPAN_BYTES = 32 << 20


def _chunk_span(meta, row_group: int, columns: set[str]) -> tuple[int, int] | None:
  """(offset, length) of the bytes holding `row_group`'s chunks of `columns` (their
  dictionary and data pages), if at most `SPAN_BYTES`; else None (and for a row group
  the file does not have: `_read` says so once the reader holds the footer)."""
  if row_group >= meta.num_row_groups:
    return None
  group = meta.row_group(row_group)
  first, last = None, 0
  for j in range(group.num_columns):
    chunk = group.column(j)
    if chunk.path_in_schema.split(".")[0] not in columns:
      continue
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
      start = min(start, chunk.dictionary_page_offset)
    first = start if first is None else min(first, start)
    last = max(last, start + chunk.total_compressed_size)
  if first is None or first < 0 or last - first > SPAN_BYTES:
    return None
  return first, last - first


_OVERSIZED = b"bagel_grain.oversized_rows"  # table metadata: row -> what was too large


def _largest_binary(array: pa.Array) -> np.ndarray:
  """Per row of a column: the length of its largest binary value (0 for other types and
  nulls), from Arrow's offsets: no value is copied. A list of binaries counts its items."""
  kind = array.type
  if pa.types.is_list(kind) or pa.types.is_large_list(kind):
    inner, parents = array.flatten(), pc.list_parent_indices(array).to_numpy()
  else:
    inner, parents = array, None
  if not (pa.types.is_binary(inner.type) or pa.types.is_large_binary(inner.type)):
    return np.zeros(len(array), np.int64)
  lengths = pc.fill_null(pc.binary_length(inner), 0).to_numpy().astype(np.int64)
  if parents is None:
    return lengths
  largest = np.zeros(len(array), np.int64)
  np.maximum.at(largest, parents, lengths)
  return largest


def _drop_oversized_cells(batches, limit: int) -> pa.Table:
  """The row group's batches as one table, each binary cell over `limit` bytes (an image
  over `max_image_bytes`) replaced by null as its batch arrives, and its row noted in
  the table's metadata; `__getitem__` drops that row as `file_too_large`. The value is
  never copied into Python nor decoded, and the cached table does not hold it: the row
  group cache stays within its bound."""
  kept, noted, first = [], {}, 0
  for batch in batches:
    columns = []
    for name, column in zip(batch.schema.names, batch.columns):
      largest = _largest_binary(column)
      over = largest > limit
      if over.any():
        for row in np.flatnonzero(over):
          noted.setdefault(str(first + int(row)), f"column {name!r} holds {int(largest[row])} "
                           f"bytes, over max_image_bytes {limit}")
        # take() with null indices copies just what stays (if_else would size its
        # output buffer by the input's, large value included).
        column = pc.take(column, pa.array(np.arange(len(column)), mask=over),
                         memory_pool=_memory_pool())
      columns.append(column)
    kept.append(pa.RecordBatch.from_arrays(columns, schema=batch.schema))
    first += batch.num_rows
    del batch, columns
  table = pa.Table.from_batches(kept)
  return table.replace_schema_metadata({_OVERSIZED: json.dumps(noted)}) if noted else table


def _nbytes(value: Any) -> int:
  if isinstance(value, (bytes, str)):
    return len(value)
  if isinstance(value, list):
    return sum(_nbytes(v) for v in value)
  return 8


def dataset_files(data_dir: str, num_used: int | None) -> list[str]:
  """The dataset's parquet files; upstream repeats the sorted list to `num_used` files."""
  files = fs.list_files(data_dir, ".parquet")
  if not files:
    raise DatasetError("no .parquet files in data_dir", file=data_dir, field="data_dir")
  if num_used is None:
    return files
  return [files[i % len(files)] for i in range(num_used)]


def dataset_source(data_dir: str, num_used: int | None, columns: Sequence[str],
                   parquet_info_path: str | None = None, *, readers: int = 1,
                   cache_bytes: int = DEFAULT_CACHE_BYTES,
                   max_cell_bytes: int | None = None) -> ParquetRowSource:
  """The rows of a parquet dataset folder (see `dataset_catalog`; `readers`,
  `cache_bytes` and `max_cell_bytes` as in `ParquetRowSource`)."""
  catalog = dataset_catalog(data_dir, num_used, columns, parquet_info_path)
  return ParquetRowSource(catalog.files, columns, catalog=catalog, readers=readers,
                          cache_bytes=cache_bytes, max_cell_bytes=max_cell_bytes)
