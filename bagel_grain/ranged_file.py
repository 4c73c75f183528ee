"""An object in a bucket as a seekable, read-only file object over ranged reads (for PyAV).

PyAV reads through a Python file object; this one answers each read from a bounded
buffer of blocks, fetching a missing block (and, while reads go forward, a growing run
of the blocks after it, up to 2 MiB) with one ranged read. A video sample demuxes every
packet first (its frame count is its packet count, as decord counts, and an MP4's
keyframe flags come from the packets' bytes, not only from its index), so every byte
of the object is read once, in order; then the seek plan reads the ranges it needs
again. An object of at most `WHOLE_BYTES` (the buffer's size) is fetched whole, in one
request, on its first read, and both passes are served from memory. A larger one is
streamed through the buffer, never held whole in memory: a block leaving the buffer is
written to an anonymous temporary file (`tempfile.TemporaryFile` under `TMPDIR`:
unlinked at once, so nothing is left behind even by a killed process; at most the
object's size, which `max_video_bytes` bounds), and the second pass reads it from
there, so each byte is fetched once. Where that file cannot be made or written (no
`TMPDIR`, a full disk), it is given up, logged once per process, and the blocks are
fetched again as needed: the same frames, at up to twice the bytes.

The ranged read is the caller's (`read_range(offset, length) -> bytes`, retried under
the storage policy there). PyAV treats an exception from a file object's `read` as the
end of the file, so the first one is kept in `failure` and raised again by every later
read: `video.read_video_frames` raises it in place of whatever FFmpeg concluded.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import posixpath
import tempfile
from typing import Callable

from bagel_grain import fs

log = logging.getLogger(__name__)

BLOCK_BYTES = 256 << 10  # the unit of the buffer and of a ranged read
MAX_BLOCKS = 16  # the buffer: 4 MiB per open video, at most
WHOLE_BYTES = BLOCK_BYTES * MAX_BLOCKS  # an object this small is read whole, in one request
_spill_warned = False  # a spill file failed in this process: logged once


class _Spill:
  """Blocks that left the buffer, in an anonymous temporary file at their own offsets
  (made on the first one). After its first failure it holds nothing: `error` tells why."""

  def __init__(self, name: str, block_bytes: int):
    self._name, self._block = name, block_bytes
    self._file: io.FileIO | None = None
    self._held: set[int] = set()
    self.error: OSError | None = None

  def __contains__(self, index: int) -> bool:
    return index in self._held

  def put(self, index: int, data: bytes) -> None:
    if index in self._held or self.error is not None:
      return
    try:
      if self._file is None:
        self._file = tempfile.TemporaryFile(buffering=0)
      self._file.seek(index * self._block)
      if self._file.write(data) != len(data):
        raise OSError(f"a short write of {len(data)} bytes")
    except OSError as e:
      self._fail(e)
      return
    self._held.add(index)

  def get(self, index: int, length: int) -> bytes | None:
    """The block, or None when it was never kept or cannot be read back."""
    if index not in self._held:
      return None
    try:
      self._file.seek(index * self._block)
      data = self._file.read(length)
      if len(data) != length:
        raise OSError(f"{len(data)} of {length} bytes read back")
    except OSError as e:
      self._fail(e)
      return None
    return data

  def close(self) -> None:
    self._held.clear()
    if self._file is not None:
      self._file.close()
      self._file = None

  def _fail(self, error: OSError) -> None:
    global _spill_warned  # pylint: disable=global-statement
    self.error = error
    self.close()
    if not _spill_warned:
      _spill_warned = True
      log.warning("%s: no temporary file for a large video's blocks (%s: %s; TMPDIR "
                  "names its folder): a video over %d bytes is read again from the bucket "
                  "where its frames need it, up to twice its bytes. Logged once.", self._name,
                  type(error).__name__, error, WHOLE_BYTES)


class RangedFile(io.RawIOBase):
  """`size` bytes at `name`, read through `read_range`; `head`: bytes from offset 0 already
  read (by read-ahead), kept as the first blocks. `requests` and `bytes_read` count the
  ranged reads made; `spill_error` is why the temporary file was given up, if it was."""

  def __init__(self, name: str, size: int, read_range: Callable[[int, int], bytes], *,
               head: bytes = b"", close: Callable[[], None] | None = None,
               block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS,
               whole_bytes: int = WHOLE_BYTES):
    super().__init__()
    self.name = posixpath.basename(name)  # FFmpeg probes the format with it, as with a path
    self.size, self._read_range, self._close = size, read_range, close
    self._block, self._max_blocks = block_bytes, max(1, max_blocks)
    self._whole = size <= whole_bytes and size <= block_bytes * self._max_blocks
    self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
    self._spill = _Spill(self.name, block_bytes)
    self._position, self._next, self._run = 0, -1, 1
    self.requests, self.bytes_read = 0, 0
    self.failure: BaseException | None = None
    for start in range(0, len(head) - len(head) % block_bytes, block_bytes):
      self._keep(start // block_bytes, head[start:start + block_bytes])
    if head and len(head) >= size and size % block_bytes:
      self._keep(len(head) // block_bytes, head[len(head) - len(head) % block_bytes:size])

  @property
  def spill_error(self) -> OSError | None:
    return self._spill.error

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self._position

  def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
    base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
    if base + offset < 0:
      raise ValueError(f"seek to {base + offset}, before the start of {self.name}")
    self._position = base + offset
    return self._position

  def read(self, n: int = -1) -> bytes:
    if self.failure is not None:
      raise self.failure
    end = self.size if n is None or n < 0 else min(self.size, self._position + n)
    out = []
    try:
      while self._position < end:
        index, offset = divmod(self._position, self._block)
        piece = self._get(index)[offset:offset + end - self._position]
        out.append(piece)
        self._position += len(piece)
    except BaseException as e:  # pylint: disable=broad-except  # kept for after PyAV's call
      self.failure = e
      raise
    return b"".join(out)

  def readinto(self, buffer) -> int:
    data = self.read(len(buffer))
    buffer[:len(data)] = data
    return len(data)

  def close(self) -> None:
    if not self.closed and self._close is not None:
      self._close()
    self._blocks.clear()
    self._spill.close()
    super().close()

  def _get(self, index: int) -> bytes:
    if index in self._blocks:
      self._blocks.move_to_end(index)
      return self._blocks[index]
    kept = self._spill.get(index, min(self._block, self.size - index * self._block))
    if kept is not None:
      self._keep(index, kept)
      return kept
    if self._whole:  # from here to the end (the whole object, on the first read)
      first, count = index, -(-self.size // self._block) - index
    else:  # a run that doubles while reads go forward (demuxing), one block after a seek
      self._run = min(2 * self._run, self._max_blocks // 2 or 1) if index == self._next else 1
      first, count = index, self._run
    count = next((i for i in range(1, count)
                  if first + i in self._blocks or first + i in self._spill), count)
    start = first * self._block
    length = min(count * self._block, self.size - start)
    data = self._read_range(start, length)
    self.requests += 1
    self.bytes_read += len(data)
    if len(data) != length:
      raise OSError(f"{self.name}: read {len(data)} bytes at {start}, expected {length} "
                    "(the object changed while it was read)")
    for i in range(count):
      self._keep(first + i, data[i * self._block:(i + 1) * self._block])
    self._next = first + count
    return self._blocks[index]

  def _keep(self, index: int, data: bytes) -> None:
    self._blocks[index] = data
    self._blocks.move_to_end(index)
    while len(self._blocks) > self._max_blocks:
      self._spill.put(*self._blocks.popitem(last=False))


@dataclasses.dataclass(frozen=True)
class VideoHead:
  """A video object named to the read-ahead (`sources.readahead`): its size and first
  `WHOLE_BYTES` are read ahead, so a small clip costs its consumer no request at all."""

  path: str


def read_head(path: str) -> tuple[tuple[fs.FileInfo, bytes], int]:
  """(the object's `FileInfo`, its first `WHOLE_BYTES` bytes), and the bytes held: one
  HEAD, one ranged read. Tried once, as every read ahead."""
  handle = fs.open_object(path)
  head = handle.read_at(min(handle.size(), WHOLE_BYTES), 0)
  return (handle.info, head), len(head)
