"""Real video files written with PyAV, and a reference decoder that reads every frame in order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import av
import numpy as np

# Encoder settings that make the bytes reproducible (libx264 rewrites its stream per run
# unless `mbtree=0`; muxers stamp their version unless `+bitexact`), and fast.
_OPTIONS = {
    "libx264": lambda v: {"g": str(v.keyint), "bf": str(v.bframes), "mbtree": "0",
                          "sc_threshold": "0", "preset": "veryfast", "threads": "1"},
    "libvpx-vp9": lambda v: {"g": str(v.keyint), "deadline": "realtime", "cpu-used": "8",
                             "threads": "1"},
    "mpeg4": lambda v: {"g": str(v.keyint), "bf": str(v.bframes)},
}


@dataclasses.dataclass(frozen=True)
class VideoSpec:
  name: str
  codec: str = "libx264"
  size: tuple[int, int] = (320, 240)
  frames: int = 48
  rate: int = 24
  keyint: int = 12
  bframes: int = 2
  pix_fmt: str = "yuv420p"


def frame_pixels(i: int, size: tuple[int, int]) -> np.ndarray:
  """Frame i: a gradient, a bar whose length and a colour that change with i."""
  w, h = size
  a = np.zeros((h, w, 3), np.uint8)
  a[..., 0] = (i * 37) % 256
  a[..., 2] = (np.arange(w)[None, :] * 255 // max(w - 1, 1)).astype(np.uint8)
  a[: h // 2, : (i * 7) % w + 1, 1] = 220
  return a


def write_video(folder: Path, spec: VideoSpec) -> Path:
  path = folder / spec.name
  with av.open(str(path), "w", options={"fflags": "+bitexact"}) as out:
    stream = out.add_stream(spec.codec, rate=spec.rate)
    stream.width, stream.height = spec.size
    stream.pix_fmt = spec.pix_fmt
    stream.options = _OPTIONS[spec.codec](spec)
    for i in range(spec.frames):
      frame = av.VideoFrame.from_ndarray(frame_pixels(i, spec.size), format="rgb24")
      out.mux(stream.encode(frame))
    out.mux(stream.encode())
  return path


def decode_all(path) -> list[np.ndarray]:
  """Every frame from the start, in the order the decoder gives them: the reference."""
  with av.open(str(path)) as container:
    return [np.asarray(frame.to_image()) for frame in container.decode(video=0)]
