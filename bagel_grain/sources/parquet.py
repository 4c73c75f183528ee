"""Random access to parquet rows, indexed from the files' footers (no data scan)."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bagel_grain import fs
from bagel_grain.errors import DatasetError
from bagel_grain.sources.base import PartOffsets

_CACHED_ROW_GROUPS = 4  # per process; rows are read in row-group-blocked order


def _footer(path: str) -> pq.FileMetaData:
  try:
    with fs.open_random_access(path) as f:
      return pq.ParquetFile(f).metadata
  except (OSError, pa.ArrowException) as e:
    raise DatasetError(f"cannot read parquet footer: {e}", file=path) from None


class ParquetRowSource:
  """Rows of a list of parquet files (repeats allowed), as dicts of `columns`.

  Index order is file by file, row group by row group; `block_sizes()` gives the
  row groups' sizes so the order layer can shuffle them as units and read
  each row group once per pass. A small LRU of decoded row groups serves the rows.
  """

  def __init__(self, files: Sequence[str], columns: Sequence[str]):
    self._files = list(files)
    self._columns = list(columns)
    unique = sorted(set(self._files))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      footers = dict(zip(unique, pool.map(_footer, unique)))
    for path, meta in footers.items():
      names = set(meta.schema.to_arrow_schema().names)
      for column in self._columns:
        if column not in names:
          raise DatasetError(f"parquet file lacks column {column!r}; it has {sorted(names)}",
                             file=path, field=column)
    block_file, block_rg, sizes = [], [], []
    for file_index, path in enumerate(self._files):
      meta = footers[path]
      for rg in range(meta.num_row_groups):
        n = meta.row_group(rg).num_rows
        if n:
          block_file.append(file_index)
          block_rg.append(rg)
          sizes.append(n)
    self._block_file = np.asarray(block_file, np.int64)
    self._block_rg = np.asarray(block_rg, np.int64)
    self._blocks = PartOffsets(sizes)
    # Row number of each block's first row within its file, for record ids.
    file_row = np.zeros(len(sizes), np.int64)
    for b in range(1, len(sizes)):
      if block_file[b] == block_file[b - 1]:
        file_row[b] = file_row[b - 1] + sizes[b - 1]
    self._block_file_row = file_row
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self.row_group_reads = 0
    self.bytes_read = 0  # decoded row-group bytes, against bytes_served: the cost of blocking
    self.bytes_served = 0

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_cache"] = collections.OrderedDict()
    state["_lock"] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._blocks)

  def block_sizes(self) -> np.ndarray:
    return self._blocks.sizes

  def record_id(self, index: int) -> str:
    block, row = self._blocks.locate(index)
    return f"{self._files[self._block_file[block]]}#{int(self._block_file_row[block]) + row}"

  def _row_group(self, block: int) -> dict[str, list]:
    key = (self._files[self._block_file[block]], int(self._block_rg[block]))
    with self._lock:
      if key in self._cache:
        self._cache.move_to_end(key)
        return self._cache[key]
    with fs.open_random_access(key[0]) as f:
      table = pq.ParquetFile(f).read_row_group(key[1], columns=self._columns)
    columns = {name: table.column(name).to_pylist() for name in self._columns}
    with self._lock:
      self.row_group_reads += 1
      self.bytes_read += table.nbytes
      self._cache[key] = columns
      while len(self._cache) > _CACHED_ROW_GROUPS:
        self._cache.popitem(last=False)
    return columns

  def __getitem__(self, index: int) -> dict[str, Any]:
    block, row = self._blocks.locate(index)
    columns = self._row_group(block)
    fields = {name: values[row] for name, values in columns.items()}
    self.bytes_served += sum(_nbytes(v) for v in fields.values())
    return fields


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
