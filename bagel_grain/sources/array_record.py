"""Random access to converted records in ArrayRecord files (true global shuffling).

Each record is one framed row or line (see `framing`), written by
`bagel_grain.tooling.convert`. Every record is its own block, so the order layer shuffles
them one by one across all files: no row-group locality is needed to read fast.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import os
from typing import Any, Sequence

import grain
import numpy as np
from array_record.python import array_record_module

from bagel_grain import fs
from bagel_grain.drops import Drop, DropReason
from bagel_grain.errors import DatasetError
from bagel_grain.sources import framing
from bagel_grain.sources.array_record_sizes import record_sizes
from bagel_grain.sources.base import PartOffsets

SUFFIX = ".array_record"


@dataclasses.dataclass(frozen=True)
class _FileInstruction:
  """A whole file for Grain's source, with its record count known (no second open)."""

  filename: str
  skip: int
  take: int
  examples_in_shard: int


def array_record_files(path: str) -> list[str]:
  """`path` itself, or the `*.array_record` files of the folder `path`, sorted by name."""
  if not fs.is_dir(path):
    return [path]
  files = fs.list_files(path, SUFFIX)
  if not files:
    raise DatasetError(f"no {SUFFIX} files in the folder", file=path, field="array_record_path")
  return files


def _num_records(path: str) -> int:
  """Records in the file, from its footer; a file cut short has none or fails to close."""
  try:
    reader = array_record_module.ArrayRecordReader(path)
    n = reader.num_records() if reader.ok() else 0
    reader.close()
  except (RuntimeError, ValueError, OSError) as e:
    raise DatasetError(f"cannot read ArrayRecord file, damaged or truncated: {e}",
                       file=path) from None
  if n == 0:
    raise DatasetError("ArrayRecord file holds no records: empty or truncated", file=path)
  return n


class ArrayRecordSource:
  """The framed records of a list of ArrayRecord files, decoded for the families.

  `source[i]` is what the parquet and JSONL sources give for the same record: a
  `{column: value}` dict for a parquet row, a `LineWithFiles` for a JSONL line. A
  record that does not decode raises `Drop(DropReason.CORRUPT_RECORD)` and becomes
  a dropped sample. Local files only (ArrayRecord's reader opens paths itself).
  """

  def __init__(self, paths: Sequence[str]):
    self._paths = [os.fspath(p) for p in paths]
    if not self._paths:
      raise DatasetError("no ArrayRecord files given", field="array_record_path")
    with concurrent.futures.ThreadPoolExecutor(min(16, len(self._paths))) as pool:
      counts = list(pool.map(_num_records, self._paths))
    self._offsets = PartOffsets(counts)
    self._data = grain.sources.ArrayRecordDataSource(
        [_FileInstruction(p, 0, n, n) for p, n in zip(self._paths, counts)])

    self._first, self._count = 0, len(self._offsets)
    self._sizes: dict[int, np.ndarray | None] = {}  # per file, read on first use

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_sizes"] = {}  # each process reads the footers it needs
    return state

  def __len__(self) -> int:
    return self._count

  def num_blocks(self) -> int:
    return self._count  # every record is its own block

  def restrict(self, first: int, last: int) -> ArrayRecordSource:
    if (first, last) == (0, self.num_blocks()):
      return self
    part = copy.copy(self)
    part._first, part._count = self._first + first, last - first
    return part

  def block_sizes(self) -> np.ndarray:
    return np.ones(len(self), np.int64)

  def _check(self, index: int) -> int:
    """The index in the whole file list; IndexError outside this source."""
    if not 0 <= index < self._count:
      raise IndexError(index)
    return self._first + index

  def record_id(self, index: int) -> str:
    file, position = self._offsets.locate(self._check(index))
    return f"{self._paths[file]}:{position}"

  def record_bytes(self, index: int) -> int | None:
    """The record's size from its file's footer, unread (read-ahead admits its read by
    it: a record of a gigabyte is read alone, not beside a guess); None if unknown."""
    file, position = self._offsets.locate(self._check(index))
    if file not in self._sizes:
      self._sizes[file] = record_sizes(self._paths[file], int(self._offsets.sizes[file]))
    sizes = self._sizes[file]
    return None if sizes is None else int(sizes[position])

  def __getitem__(self, index: int) -> Any:
    index = self._check(index)
    try:
      data = self._data[index]
    except (RuntimeError, ValueError) as e:  # the reader's error for a damaged chunk
      raise Drop(DropReason.UNREADABLE_FILE, str(e)) from None
    try:
      return framing.decode(data)[1]
    except framing.FramingError as e:
      raise Drop(DropReason.CORRUPT_RECORD, str(e)) from None
