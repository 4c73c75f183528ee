"""Video for VLM rows: upstream's random frame sampling, and frames decoded from a video file."""

from __future__ import annotations

import dataclasses
from typing import IO

import numpy as np

from bagel_grain.drops import Drop, DropReason

_NO_PYAV = "video files need PyAV: pip install 'bagel_grain[video]'"


@dataclasses.dataclass(frozen=True)
class FrameSamplerArgs:
  """Upstream's `frame_sampler_args`: how many frames a video sample takes."""

  max_num_frames: int = 12
  min_num_frames: int = 8


def sample_frame_indices(vlen: int, min_frames: int, max_frames: int,
                         rng: np.random.Generator) -> list[int]:
  """Upstream's 'rand' sampler: t frames, one random frame per linspace interval.

  t = randint(min, max + 1); interval i is [a_i, a_{i+1} - 1), an empty one sends
  the whole draw to a sorted random permutation; short clips are padded with the
  last frame.
  """
  if vlen < 1:  # e.g. a video file with no decodable frame: a bad record, not a crash
    raise Drop(DropReason.VIDEO_UNREADABLE, "the video has no frames")
  t = int(rng.integers(min_frames, max_frames + 1))
  kept = min(t, vlen)
  bounds = np.linspace(0, vlen, kept + 1).astype(int)
  lows, highs = bounds[:-1], bounds[1:] - 1
  if np.all(highs > lows):
    indices = [int(rng.integers(lo, hi)) for lo, hi in zip(lows, highs)]
  else:
    indices = sorted(int(i) for i in rng.permutation(vlen)[:kept])
  return indices + [indices[-1]] * (t - len(indices))


def _pyav():
  """PyAV, imported on first use: only rows with a video file need the `video` extra."""
  try:
    import av  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise Drop(DropReason.VIDEO_UNREADABLE, _NO_PYAV) from None
  return av


def read_video_frames(path: str | IO[bytes], indices: list[int]):
  """Frames of a video file as RGB PIL images, through PyAV (the `video` extra)."""
  av = _pyav()
  wanted = set(indices)
  frames = {}
  try:
    with av.open(path) as container:
      for i, frame in enumerate(container.decode(video=0)):
        if i in wanted:
          frames[i] = frame.to_image()
        if len(frames) == len(wanted):
          break
  except (av.error.FFmpegError, OSError, ValueError) as e:
    raise Drop(DropReason.VIDEO_UNREADABLE, str(e)) from None
  if len(frames) != len(wanted):
    raise Drop(DropReason.VIDEO_UNREADABLE, f"{path}: has fewer frames than its index")
  return [frames[i] for i in indices]


def count_video_frames(path: str | IO[bytes]) -> int:
  av = _pyav()
  try:
    with av.open(path) as container:
      stream = container.streams.video[0]
      if stream.frames:
        return int(stream.frames)
      return sum(1 for _ in container.decode(video=0))
  except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
    raise Drop(DropReason.VIDEO_UNREADABLE, str(e)) from None
