"""What a video file's own headers claim, read by us before FFmpeg trusts them.

FFmpeg's MP4 demuxer builds an index entry for every sample the `moov` box's tables
claim while it opens the file (and a fragmented file's `trun` boxes, as it reaches
them): a 117 KB file claiming 85M samples costs gigabytes before the first packet. `mp4_claims` walks the boxes with a few small reads (never
a table's entries) and gives each track's claimed sample count, so a claim over the
bound is refused first. `jpeg_size` reads an MJPEG packet's frame size from its SOF
header, so a frame is refused by its size before the decoder allocates it.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import IO

import numpy as np

from bagel_grain.drops import DropReason, require

MAX_TOP_BOXES = 4096  # boxes before `moov`; an MP4 writer puts it among the first few
MAX_MOOV_BOXES = 65536  # boxes inside `moov`: a few dozen per track
_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts"}
# Each sample table: bytes before its entries (after the box header), bytes per entry.
_TABLES = {b"stts": (8, 8), b"ctts": (8, 8), b"stsc": (8, 12), b"stco": (8, 4),
           b"co64": (8, 8), b"stss": (8, 4), b"stps": (8, 4), b"elst": (8, None)}
_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (not DHT, JPG, DAC)


@dataclasses.dataclass(frozen=True)
class TrackClaims:
  """One `trak`'s handler (`vide`, `soun`, ...) and the most samples any of its tables
  claims (sizes, time-to-sample, composition offsets)."""

  handler: bytes
  samples: int


def _header(f: IO[bytes], at: int, end: int) -> tuple[bytes, int, int] | None:
  """(type, payload start, box end) of the box at `at`, or None past `end`."""
  if at + 8 > end:
    return None
  f.seek(at)
  head = f.read(16)
  require(len(head) >= 8, DropReason.VIDEO_UNREADABLE, f"an MP4 box header at {at} is cut")
  size, kind = struct.unpack(">I4s", head[:8])
  payload = at + 8
  if size == 1:
    require(len(head) == 16, DropReason.VIDEO_UNREADABLE, f"an MP4 box header at {at} is cut")
    size, payload = struct.unpack(">Q", head[8:16])[0], at + 16
  elif size == 0:
    size = end - at  # to the end of the file (or of the parent)
  require(size >= payload - at and at + size <= end, DropReason.VIDEO_UNREADABLE,
          f"the MP4 box {kind!r} at {at} claims {size} bytes, past its parent's end {end}")
  return kind, payload, at + size


def _fields(f: IO[bytes], at: int, count: int) -> tuple[int, ...]:
  f.seek(at)
  data = f.read(4 * count)
  require(len(data) == 4 * count, DropReason.VIDEO_UNREADABLE, f"an MP4 table at {at} is cut")
  return struct.unpack(f">{count}I", data)


def _table_claim(f: IO[bytes], kind: bytes, payload: int, end: int, limit: int) -> int:
  """Samples a table claims (any number over `limit` once it is known to be over); its
  entries must fit in its box."""
  if kind == b"stsz":
    _, fixed, count = _fields(f, payload, 3)
    require(fixed or 12 + 4 * count <= end - payload, DropReason.VIDEO_UNREADABLE,
            f"the MP4 sample sizes claim {count} entries, more than their box holds")
    return count
  start, entry = _TABLES[kind]
  _, entries = _fields(f, payload, 2)
  require(start + (entry or 12) * entries <= end - payload, DropReason.VIDEO_UNREADABLE,
          f"the MP4 table {kind.decode()} claims {entries} entries, more than its box holds")
  if kind not in (b"stts", b"ctts") or entries > limit:
    return entries  # each entry of a time table counts at least one sample in a valid file
  # (sample count, value) pairs: the claim is the sum of the counts.
  f.seek(payload + start)
  data = f.read(8 * entries)
  require(len(data) == 8 * entries, DropReason.VIDEO_UNREADABLE, f"the MP4 {kind!r} is cut")
  return int(np.frombuffer(data, ">u4")[0::2].sum(dtype=np.uint64))


@dataclasses.dataclass(frozen=True)
class Mp4Claims:
  """What an MP4's header claims: each track's samples (`moov`), and for a fragmented file
  (`mvex`) the samples its fragments' runs (`moof/traf/trun`) add, all tracks together."""

  tracks: list[TrackClaims]
  fragment_samples: int = 0


def _boxes(f: IO[bytes], at: int, end: int, most: int):
  """The boxes from `at` to `end` (a file's top level, or a box's children), at most
  `most` of them: more is unreadable."""
  for _ in range(most):
    box = _header(f, at, end)
    if box is None:
      return
    yield box
    at = box[2]
  require(_header(f, at, end) is None, DropReason.VIDEO_UNREADABLE,
          f"an MP4 file or box holds more than {most} boxes")


def _run_samples(f: IO[bytes], payload: int, end: int) -> int:
  """Samples a fragment's run (`trun`) claims; its per-sample fields must fit in its box
  (a run with none, all from defaults, claims its count in 4 bytes: hence the bound)."""
  flags, count = _fields(f, payload, 2)
  fields = bin(flags & 0xF00).count("1")  # duration, size, flags, composition offset
  head = 8 + 4 * bin(flags & 0x5).count("1")  # data offset, first sample's flags
  require(head + 4 * fields * count <= end - payload, DropReason.VIDEO_UNREADABLE,
          f"an MP4 fragment's run claims {count} samples, more than its box holds")
  return count


def _fragment_samples(f: IO[bytes], box: tuple[bytes, int, int]) -> int:
  total = 0
  for kind, payload, end in _boxes(f, box[1], box[2], MAX_MOOV_BOXES):
    if kind == b"traf":
      total += sum(_run_samples(f, p, e) for k, p, e in _boxes(f, payload, end, MAX_MOOV_BOXES)
                   if k == b"trun")
  return total


def mp4_claims(f: IO[bytes], size: int, limit: int) -> Mp4Claims | None:
  """What an MP4/MOV file's header claims (None: not an MP4, or no `moov`, which FFmpeg
  then refuses; more than `MAX_TOP_BOXES` boxes before it is unreadable). A claim is exact up
  to `limit` (a table is read whole only while that small); a fragmented file's boxes
  are walked to its end (each fragment holds a sample: at most `limit` fragments), and
  the walk stops once its runs claim more than `limit` samples."""
  f.seek(4)
  if f.read(4) not in (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot"):
    return None
  moov = next((box for box in _boxes(f, 0, size, MAX_TOP_BOXES) if box[0] == b"moov"), None)
  if moov is None:
    return None
  tracks: list[TrackClaims] = []
  todo, seen, fragmented = [(moov, None)], 0, False
  while todo:
    (kind, payload, end), track = todo.pop()
    at = payload
    while (box := _header(f, at, end)) is not None:
      seen += 1
      require(seen <= MAX_MOOV_BOXES, DropReason.VIDEO_UNREADABLE,
              f"the MP4 header holds more than {MAX_MOOV_BOXES} boxes")
      child, child_payload, child_end = box
      fragmented = fragmented or child == b"mvex"
      if child == b"trak":
        track = len(tracks)
        tracks.append(TrackClaims(b"", 0))
      if child in _CONTAINERS:
        todo.append((box, track))
      elif track is not None and child == b"hdlr":
        handler = bytes(_fields(f, child_payload + 8, 1)[0].to_bytes(4, "big"))
        tracks[track] = dataclasses.replace(tracks[track], handler=handler)
      elif track is not None and (child == b"stsz" or child in _TABLES):
        claim = _table_claim(f, child, child_payload, child_end, limit)
        if child in (b"stsz", b"stts", b"ctts"):
          tracks[track] = dataclasses.replace(
              tracks[track], samples=max(tracks[track].samples, claim))
      at = child_end
  samples = 0
  if fragmented:
    for box in _boxes(f, moov[2], size, 2 * limit + MAX_TOP_BOXES):
      if box[0] == b"moof":
        samples += _fragment_samples(f, box)
        if samples > limit:
          break
  return Mp4Claims(tracks, samples)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
  """(width, height) from a JPEG's frame header, or None when the bytes hold none."""
  at = 2 if data[:2] == b"\xff\xd8" else None
  while at is not None and at + 9 <= len(data):
    if data[at] != 0xFF:
      return None
    marker = data[at + 1]
    if marker == 0xFF:  # fill byte
      at += 1
      continue
    if marker in _SOF:
      height, width = struct.unpack_from(">HH", data, at + 5)
      return width, height
    if marker == 0xDA:  # scan data before any frame header
      return None
    at += 2 + struct.unpack_from(">H", data, at + 2)[0]
  return None
