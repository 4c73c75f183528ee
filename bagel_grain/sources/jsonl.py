"""Random access to JSONL lines through a byte-offset index (the file is never held whole)."""

from __future__ import annotations

import random

import numpy as np

from bagel_grain import fs

_CHUNK = 1 << 22


def line_offsets(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Start and end byte offsets of every line, as upstream's `readlines()` splits them.

  The end excludes the line break (`\\n` or `\\r\\n`); a last line without a final
  newline counts, an empty tail after the final newline does not.
  """
  starts, ends = [0], []
  position = 0
  with fs.open_random_access(path) as f:
    while True:
      chunk = f.read(_CHUNK)
      if not chunk:
        break
      buf = np.frombuffer(chunk, np.uint8)
      newlines = np.flatnonzero(buf == 10) + position
      ends.extend(newlines.tolist())
      starts.extend((newlines + 1).tolist())
      position += len(chunk)
  if starts[-1] == position:  # nothing after the final newline
    starts.pop()
  else:
    ends.append(position)
  return np.asarray(starts, np.int64), np.asarray(ends, np.int64)


class JsonlLineSource:
  """Lines of one JSONL file as raw bytes (parsing happens in the family transform).

  `num_used` and `shuffle_lines`/`shuffle_seed` keep upstream's meaning: the
  line list is shuffled with `random.Random(shuffle_seed)` (an explicit RNG, the
  same permutation upstream's shuffle of `readlines()` makes), then cut.
  """

  def __init__(self, path: str, *, num_used: int | None = None, shuffle_lines: bool = False,
               shuffle_seed: int = 0):
    self._path = path
    starts, ends = line_offsets(path)
    order = list(range(len(starts)))
    if shuffle_lines:
      random.Random(shuffle_seed).shuffle(order)
    if num_used is not None:
      order = order[:num_used]
    order = np.asarray(order, np.int64)
    self._line = order
    self._start = starts[order] if len(order) else starts[:0]
    self._end = ends[order] if len(order) else ends[:0]
    self._file = None

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_file"] = None
    return state

  def __len__(self) -> int:
    return len(self._line)

  def block_sizes(self) -> np.ndarray:
    return np.ones(len(self), np.int64)  # every record is its own block

  def record_id(self, index: int) -> str:
    return f"{self._path}:{int(self._line[index]) + 1}"

  def __getitem__(self, index: int) -> bytes:
    if self._file is None:
      self._file = fs.open_random_access(self._path)
    start, end = int(self._start[index]), int(self._end[index])
    data = self._file.read_at(end - start, start)
    return data[:-1] if data.endswith(b"\r") else data

