"""What every record source offers, and the index lookup of sources laid out in parts."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class RecordSource(Protocol):
  """Random access to one dataset's raw records (Grain's `RandomAccessDataSource`, plus two).

  `source[i]` is the record as its family parses it (a parquet row's `{column:
  value}`, a JSONL line's bytes, a converted line's `LineWithFiles`). For one
  record it cannot read it raises `drops.Drop`; a file that fails mid-run may
  raise OSError or pyarrow's ArrowException. Either way the record becomes a
  dropped sample, never a crash.

  `block_sizes()` splits the indices, in order, into runs the epoch shuffle keeps
  together (a parquet row group is read once per pass); `record_id(i)` names the
  record for stats and errors (`file#row` or `file:line`).

  `num_blocks()` is known before anything per record is loaded, and
  `restrict(first, last)` is the source of blocks [first, last) only: a process
  loads just its own share of a large corpus (see `records.ShuffledRecords`).
  """

  def __len__(self) -> int: ...

  def num_blocks(self) -> int: ...

  def restrict(self, first: int, last: int) -> RecordSource: ...

  def __getitem__(self, index: int) -> Any: ...

  def block_sizes(self) -> np.ndarray: ...

  def record_id(self, index: int) -> str: ...


class PartOffsets:
  """Indices of parts laid end to end (files, row groups, datasets) -> (part, index in part)."""

  def __init__(self, sizes: Sequence[int] | np.ndarray):
    self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

  def __len__(self) -> int:
    return int(self.starts[-1])

  @property
  def sizes(self) -> np.ndarray:
    return np.diff(self.starts)

  def locate(self, index: int) -> tuple[int, int]:
    """(part, index within that part); IndexError outside `0 <= index < len(self)`."""
    if not 0 <= index < len(self):
      raise IndexError(index)
    part = int(np.searchsorted(self.starts, index, side="right")) - 1
    return part, index - int(self.starts[part])
