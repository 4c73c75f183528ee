"""Whether a parquet footer's row counts can be true, checked before anything is sized by them.

A footer is a few hundred bytes anyone can edit: a 4-row row group may claim 1e9
rows, and the epoch's order (a permutation of every row) would then take 8 GB.
Before any count is used, each must agree with the rest of the footer and with
the bytes the file holds:

- the row groups' rows add up to the file's;
- every column chunk holds at least one value (or null) per row its row group claims;
- a row group claims at most `MAX_ROWS_PER_BYTE` rows per byte of its column chunks
  on disk: pyarrow's own writer, with its 20,000-row page limit, reaches about 550
  on a column of nulls, and no BAGEL row (an image, a caption) is that small. Rows
  packed denser are refused as a decompression bomb would be.

A footer that passes and still lies (every count edited alike) is found when the
row group is read: `ParquetRowSource` drops the rows it does not hold.

The footers a build read (checked) are kept, a few per process (`keep`, `known`): the
first row groups' reads find theirs there instead of reading it again (on a bucket one
round trip before the first batch).

A small dataset in a bucket (every file at most `whole_objects.OBJECT_BYTES`, all of them
within what the process may still hold, `whole_objects.BUDGET`) is read whole at build:
one pinned GET per file in place of its footer's (`read_whole`, then `read`), and its row
groups are then read from those bytes (`held`), in this process and in the workers its
sources are pickled to:
on a bucket the first batch waits on no row-group request after the build, and every
process reads the bytes the build saw.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bagel_grain import fs
from bagel_grain.errors import DatasetError
from bagel_grain.sources import whole_objects

MAX_ROWS_PER_BYTE = 1000


def check_footer(meta: pq.FileMetaData, path: str, file_bytes: int | None = None,
                 columns: Sequence[str] | None = None) -> None:
  """DatasetError naming `path` and the row group when its counts cannot be true.

  `file_bytes`: the file's size, when known (the chunks' sizes are the footer's word
  too). `columns`: the top-level columns whose chunks are checked (None: all of them).
  """
  claimed = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
  if sum(claimed) != meta.num_rows:
    raise DatasetError(_lie(f"its row groups hold {sum(claimed)} rows in all, its footer says "
                            f"{meta.num_rows}"), file=path)
  for index, rows in enumerate(claimed):
    if rows < 0:
      raise DatasetError(_lie(f"row group {index} claims {rows} rows"), file=path)
    if rows == 0:
      continue
    group = meta.row_group(index)
    stored = 0
    for j in range(group.num_columns):
      chunk = group.column(j)
      if columns is not None and chunk.path_in_schema.split(".")[0] not in columns:
        continue
      if chunk.num_values < rows:
        raise DatasetError(_lie(f"row group {index} claims {rows} rows, but its column "
                                f"{chunk.path_in_schema!r} holds {chunk.num_values} values"),
                           file=path)
      stored += max(0, chunk.total_compressed_size)
    if file_bytes is not None:
      stored = min(stored, file_bytes)
    if rows > MAX_ROWS_PER_BYTE * stored:
      raise DatasetError(_lie(f"row group {index} claims {rows} rows in {stored} bytes of "
                              f"column chunks, more than {MAX_ROWS_PER_BYTE} rows a byte"),
                         file=path)


def _lie(what: str) -> str:
  return (f"parquet footer cannot be true: {what}. The file is damaged or was edited: "
          "rewrite it, or remove it from the dataset")


def check_indexed_rows(row_group_rows: np.ndarray, file_bytes: int, path: str,
                       index: str) -> None:
  """The sidecar index's row counts for a file against the file's size (an index written
  before these checks, or edited, is held to the same bound as a footer)."""
  rows = int(np.sum(row_group_rows, dtype=np.int64))
  if np.any(row_group_rows < 0) or rows > MAX_ROWS_PER_BYTE * file_bytes:
    raise DatasetError(f"the sidecar index says {rows} rows for {path}, a file of {file_bytes} "
                       f"bytes (at most {MAX_ROWS_PER_BYTE} rows a byte, none negative). Run "
                       "`bagel-grain index CONFIG` again", file=index)


# Footers kept per process, by the file's pin (its listing): at most this many, and this
# many bytes of them as stored in their files.
KEPT_FOOTERS = 256
KEPT_FOOTER_BYTES = 16 << 20


class _Kept:
  """An LRU of checked footers by (path, content identity), bounded in count and bytes."""

  def __init__(self):
    self._footers: collections.OrderedDict[tuple, tuple[pq.FileMetaData, int]] = (
        collections.OrderedDict())
    self._bytes = 0
    self._lock = threading.Lock()

  def put(self, key: tuple, meta: pq.FileMetaData) -> None:
    size = int(meta.serialized_size)
    if size > KEPT_FOOTER_BYTES:
      return
    with self._lock:
      if key in self._footers:
        self._footers.move_to_end(key)
        return
      self._footers[key] = (meta, size)
      self._bytes += size
      while len(self._footers) > KEPT_FOOTERS or self._bytes > KEPT_FOOTER_BYTES:
        _, (_, dropped) = self._footers.popitem(last=False)
        self._bytes -= dropped

  def get(self, key: tuple) -> pq.FileMetaData | None:
    with self._lock:
      kept = self._footers.get(key)
      if kept is None:
        return None
      self._footers.move_to_end(key)
      return kept[0]


_KEPT = _Kept()


def _key(pin) -> tuple:
  """A pin (`fs.FileInfo`) as the content it stands for: a local file's probe aside (added
  to its pin once read, same content)."""
  return (pin.path, pin.size, pin.mtime_ns, pin.etag, pin.generation, pin.md5, pin.crc32c)


def keep(pin, meta: pq.FileMetaData) -> None:
  """Keeps the checked footer `meta` of the content `pin` (a listing's entry) saw."""
  _KEPT.put(_key(pin), meta)


def known(pin) -> pq.FileMetaData | None:
  """The checked footer of the content `pin` saw, if this process read it lately."""
  return None if pin is None else _KEPT.get(_key(pin))


def read_whole(pins: Sequence) -> bool:
  """Whether a dataset of the files `pins` (their listings) is read whole at build: all in
  a bucket, each at most `whole_objects.OBJECT_BYTES`, and their bytes fit in what this
  process may still hold (then reserved: `read` reads those whole)."""
  pins = list(pins)
  if not pins or not all(fs.is_uri(p.path) and p.size is not None
                         and int(p.size) <= whole_objects.OBJECT_BYTES for p in pins):
    return False
  return whole_objects.HELD.reserve({_key(p): int(p.size) for p in pins})


def held(pin) -> bytes | None:
  """The whole bytes of the content `pin` saw, if this process holds them."""
  return None if pin is None else whole_objects.HELD.get(_key(pin))


def hold(pin, data: bytes) -> None:
  """Holds `data`, the whole content `pin` saw (a worker: its source's, pickled to it)."""
  whole_objects.HELD.put(_key(pin), data)


def read(path: str, pin=None, *, at_build: bool) -> pq.FileMetaData:
  """A parquet file's footer: the one kept for the content `pin` (its listing: on a
  bucket no HEAD for its size) saw, else read now and kept for the next reads.

  An object of a dataset `read_whole` admitted (its `pin` reserved) is read whole
  instead, in one request pinned to `pin`, and held (`held`).

  `at_build`: any failure is a DatasetError naming the file, and a footer read now is
  checked (`check_footer`) before any count sizes anything. Else (a row group's read,
  of content the build checked) an error is left as raised: an OSError for the caller
  to retry, Arrow's verdict on the bytes for it to drop the rows."""
  meta = known(pin)
  if meta is not None:
    return meta
  try:
    data = held(pin)
    if (data is None and pin is not None and fs.is_uri(path)
        and whole_objects.HELD.reserved(_key(pin))):
      data = fs.read_range(path, 0, int(pin.size), pin=pin)
      if len(data) != int(pin.size):
        raise OSError(f"{path}: {len(data)} bytes read whole, {pin.size} listed")
      hold(pin, data)
    if data is not None:
      meta, size = pq.ParquetFile(pa.BufferReader(data)).metadata, len(data)
    else:
      with fs.open_random_access(path, pin=pin) as f:
        meta, size = pq.ParquetFile(f).metadata, f.size()
  except (OSError, pa.ArrowException) as e:
    if not at_build:
      raise
    raise DatasetError(f"cannot read parquet footer: {e}", file=path) from None
  if at_build:
    check_footer(meta, path, size)
  if pin is not None:
    keep(pin, meta)
  return meta
