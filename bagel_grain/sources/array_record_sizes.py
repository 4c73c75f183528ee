"""Each record's size in an ArrayRecord file, known before the record is read.

Read-ahead admits a read by its size (`readahead.ReadAhead.start`); without it the mean
of earlier reads stands in, so a huge record among small ones is read many times at
once. ArrayRecord knows every size: its footer lists each chunk's decoded size and
record count. Its Python reader does not expose them, so they are read here from the
file's last bytes, following Riegeli's layout:

- the file is made of 64 KiB blocks, each starting with a 24-byte block header; a
  chunk's bytes continue past a block header;
- a chunk is a 40-byte header (u64 header hash, data size, data hash, chunk type and
  record count in one u64, decoded data size) then its data; a "simple" chunk's data
  is a compression byte (0: none), a varint-sized list of varint record sizes, then
  the records;
- the last block holds the postscript chunk, whose record (a protobuf) gives the
  footer chunk's offset (field 1); the footer chunk's first record is metadata, then
  one record per data chunk: decoded size (field 2), records in it (field 3).

A footer this code cannot read (compressed, damaged, a layout it does not know) gives
no sizes: the read-ahead guesses, as before. A footer that lies only changes what
read-ahead admits; the reader itself checks the chunks it reads.
"""

from __future__ import annotations

import os
import struct

import numpy as np

BLOCK = 1 << 16
BLOCK_HEADER = 24
CHUNK_HEADER = struct.Struct("<QQQQQ")
_FOOTER_BYTES_PER_CHUNK = 64  # a chunk's footer entry is 3 varints: far fewer bytes
_MAX_SIZE = np.iinfo(np.uint32).max  # sizes saturate here: past the read-ahead bound anyway


class _Unreadable(Exception):
  """A footer this reader does not understand (not an error: sizes stay unknown)."""


def record_sizes(path: str, num_records: int) -> np.ndarray | None:
  """Per record of the local file `path` (`num_records` of them), the decoded size of the
  chunk holding it: what reading the record costs (uint32, saturated). None when the
  footer cannot be read here."""
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < BLOCK or size % BLOCK:
        return None
      postscript = _records(f, size - BLOCK + BLOCK_HEADER, BLOCK, size)
      footer_offset = _fields(postscript[0]).get(1)
      if footer_offset is None or not 0 < footer_offset < size:
        return None
      limit = _FOOTER_BYTES_PER_CHUNK * (num_records + 1) + BLOCK
      entries = [_fields(r) for r in _records(f, footer_offset, limit, size)[1:]]
  except (_Unreadable, OSError, IndexError, struct.error):
    return None
  counts = np.array([e.get(3, 0) for e in entries], np.int64)
  if counts.sum() != num_records or (counts < 0).any():
    return None
  sizes = np.array([min(e.get(2, 0), _MAX_SIZE) for e in entries], np.uint32)
  return np.repeat(sizes, counts)


def _read(f, position: int, n: int, file_size: int) -> tuple[bytes, int]:
  """`n` bytes of chunk content from `position`, skipping block headers; the position after."""
  out = bytearray()
  while len(out) < n:
    if position % BLOCK == 0:
      position += BLOCK_HEADER
    take = min(n - len(out), BLOCK - position % BLOCK)
    if position + take > file_size:
      raise _Unreadable("past the end of the file")
    f.seek(position)
    got = f.read(take)
    if len(got) != take:
      raise _Unreadable("short read")
    out += got
    position += take
  return bytes(out), position


def _records(f, position: int, max_data: int, file_size: int) -> list[bytes]:
  """The records of the uncompressed simple chunk at `position` (data at most `max_data`)."""
  header, position = _read(f, position, CHUNK_HEADER.size, file_size)
  _, data_size, _, _, _ = CHUNK_HEADER.unpack(header)
  if data_size > max_data:
    raise _Unreadable(f"chunk of {data_size} bytes")
  data, _ = _read(f, position, data_size, file_size)
  if not data or data[0] != 0:
    raise _Unreadable("compressed or empty chunk")
  sizes_length, i = _varint(data, 1)
  end = i + sizes_length
  sizes = []
  while i < end:
    n, i = _varint(data, i)
    sizes.append(n)
  records = []
  for n in sizes:
    if end + n > len(data):
      raise _Unreadable("record sizes overrun the chunk")
    records.append(data[end:end + n])
    end += n
  if not records:
    raise _Unreadable("no records")
  return records


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]  # IndexError past the end: unreadable
    i += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, i
    shift += 7
    if shift > 63:
      raise _Unreadable("varint too long")


def _fields(message: bytes) -> dict[int, int]:
  """The varint fields of a protobuf message (others skipped), by number; last one wins."""
  fields, i = {}, 0
  while i < len(message):
    key, i = _varint(message, i)
    kind = key & 7
    if kind == 0:
      fields[key >> 3], i = _varint(message, i)
    elif kind == 2:
      length, i = _varint(message, i)
      i += length
    elif kind == 1:
      i += 8
    elif kind == 5:
      i += 4
    else:
      raise _Unreadable(f"wire type {kind}")
  return fields
