"""Hostile video files, small on disk, for the video bound tests, tools/soak.py and the
measurements of issue 27: containers whose headers or packets promise far more work than
their bytes (packets, sample tables, frame sizes, streams)."""

from __future__ import annotations

import io
import struct
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image


def mjpeg_frame(size: tuple[int, int] = (64, 48)) -> bytes:
  """One JPEG (baseline, 4:2:0) of a flat frame, as the mjpeg encoder writes it."""
  codec = av.CodecContext.create("mjpeg", "w")
  codec.width, codec.height, codec.pix_fmt = *size, "yuvj420p"
  codec.time_base = Fraction(1, 24)
  frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), 90, np.uint8), format="rgb24")
  [packet] = codec.encode(frame.reformat(format="yuvj420p"))
  return bytes(packet)


def mux_mjpeg(path: Path, fmt: str, packets_per_stream: list[list[bytes]],
               size: tuple[int, int] = (64, 48)) -> Path:
  """A container of MJPEG streams holding the given packets (the first of each a keyframe),
  24 per second."""
  with av.open(str(path), "w", format=fmt) as out:
    streams = []
    for _ in packets_per_stream:
      stream = out.add_stream("mjpeg", rate=24)
      stream.width, stream.height, stream.pix_fmt = *size, "yuvj420p"
      streams.append(stream)
    for stream, packets in zip(streams, packets_per_stream):
      for i, data in enumerate(packets):
        packet = av.Packet(data)
        packet.stream, packet.pts, packet.dts = stream, i, i
        packet.time_base, packet.duration = Fraction(1, 24), 1
        packet.is_keyframe = i == 0
        out.mux(packet)
  return path


def many_packets_mkv(path: Path, packets: int) -> Path:
  """An MKV whose one video stream holds `packets` packets of one byte after a real frame
  (issue 27's 14 MB file holds 2M): demuxing it costs per packet, not per byte."""
  first = mjpeg_frame()
  return mux_mjpeg(path, "matroska", [[first] + [b"\x00"] * (packets - 1)])


def many_streams_mkv(path: Path, streams: int) -> Path:
  """An MKV with `streams` video streams of one frame each (a record needs one)."""
  frame = mjpeg_frame()
  return mux_mjpeg(path, "matroska", [[frame] for _ in range(streams)])


def flat_jpeg(size: tuple[int, int]) -> bytes:
  """A decodable grey JPEG of any size (multiples of 16), made without its pixels: with
  the standard tables each 8x8 block of level 128 is 6 bits (DC 0, end of block), so 4
  blocks are the 3 bytes 28 a2 8a; a 16000x16000 frame is 3 MB."""
  out = io.BytesIO()
  Image.new("L", (16, 16), 128).save(out, "JPEG")
  small = out.getvalue()
  sof = small.index(b"\xff\xc0")
  sos = small.index(b"\xff\xda")
  header = bytearray(small[: sos + 2 + struct.unpack_from(">H", small, sos + 2)[0]])
  struct.pack_into(">HH", header, sof + 5, size[1], size[0])
  blocks = (size[0] // 8) * (size[1] // 8)
  return bytes(header) + b"\x28\xa2\x8a" * (blocks // 4) + b"\xff\xd9"


def mjpeg_avi_growing_frame(path: Path, big: tuple[int, int] = (16000, 16000)) -> Path:
  """An AVI of 3 MJPEG frames: its header and frame 1 say 64x48, frame 2 is a real grey
  JPEG of `big` (16000x16000: 256M pixels, 3 MB of file)."""
  frame = mjpeg_frame()
  return mux_mjpeg(path, "avi", [[frame, flat_jpeg(big), frame]])


def _patch(data: bytearray, box: bytes, fields: dict[int, int]) -> None:
  """Sets 32-bit big-endian fields of `box`, at offsets counted from the end of its type."""
  at = data.index(box) + 4
  for offset, value in fields.items():
    struct.pack_into(">I", data, at + offset, value)


def mp4_claiming_samples(source: Path, path: Path, claimed: int) -> Path:
  """`source` (an MP4 of one video track) whose sample tables agree on `claimed` samples of
  one byte in one chunk: time-to-sample, sizes, sample-to-chunk and chunk offsets each
  hold one entry (their boxes keep their size; FFmpeg skips what follows the entries)."""
  data = bytearray(source.read_bytes())
  # Each table: version/flags (4 bytes), then its counts and first entry.
  _patch(data, b"stts", {4: 1, 8: claimed})  # 1 entry: `claimed` samples
  _patch(data, b"stsz", {4: 1, 8: claimed})  # every sample 1 byte, `claimed` of them
  _patch(data, b"stsc", {4: 1, 8: 1, 12: claimed})  # chunk 1 on: `claimed` samples per chunk
  _patch(data, b"stco", {4: 1})  # one chunk
  if b"stss" in data:
    _patch(data, b"stss", {4: 1, 8: 1})  # sample 1 is the keyframe
  if b"ctts" in data:
    _patch(data, b"ctts", {4: 1, 8: claimed})
  path.write_bytes(bytes(data))
  return path


def as_file(path: Path) -> io.BytesIO:
  return io.BytesIO(path.read_bytes())


def fragmented_mp4(path: Path, claimed: int | None = None) -> Path:
  """A fragmented MP4 (an empty `moov`, a fragment per keyframe) of 48 frames; with
  `claimed`, its first run (`trun`, whose samples take their fields from the defaults:
  no bytes each) claims that many samples."""
  from video_files import frame_pixels  # pylint: disable=import-outside-toplevel
  with av.open(str(path), "w", format="mp4",
               options={"movflags": "frag_keyframe+empty_moov", "fflags": "+bitexact"}) as out:
    stream = out.add_stream("libx264", rate=24)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    stream.options = {"g": "12", "bf": "0", "threads": "1"}
    for i in range(48):
      out.mux(stream.encode(av.VideoFrame.from_ndarray(frame_pixels(i, (64, 48)),
                                                       format="rgb24")))
    out.mux(stream.encode())
  if claimed is not None:
    data = bytearray(path.read_bytes())
    _patch(data, b"trun", {4: claimed})  # after version/flags: the sample count
    path.write_bytes(bytes(data))
  return path
