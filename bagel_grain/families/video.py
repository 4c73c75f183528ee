"""Video frames for VLM rows: upstream's random frame sampling, read from a frame folder or a file."""

from __future__ import annotations

import os
import re

import numpy as np

from bagel_grain import fs
from bagel_grain.drops import Drop, DropReason

_FRAME_NUMBER = re.compile(r"_(\d+)\.(?:jpe?g|png)$", re.IGNORECASE)
_NO_PYAV = "video files need PyAV: pip install 'bagel_grain[video]'"


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


def frame_folder(folder: str) -> list[str]:
  """Frames `*_N.jpg` of a folder, in N order; a frame linking out of the folder is refused."""
  try:
    listed = fs.list_files(folder)
  except OSError as e:
    raise Drop(DropReason.MISSING_FILE, f"video folder {folder}: {e}") from None
  frames = [(int(m.group(1)), path) for path in listed if (m := _FRAME_NUMBER.search(path))]
  if not fs.is_uri(folder):
    root = os.path.realpath(folder)
    for _, path in frames:
      if not os.path.realpath(path).startswith(root + os.sep):
        raise Drop(DropReason.PATH_OUTSIDE_DATA_DIR,
                   f"frame {path} links out of its folder")
  if not frames:
    raise Drop(DropReason.VIDEO_UNREADABLE, f"no *_N.jpg frames in {folder}")
  return [path for _, path in sorted(frames)]


def read_video_frames(path: str, indices: list[int]):
  """Frames of a video file as RGB PIL images, through PyAV (the `video` extra)."""
  try:
    import av  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise Drop(DropReason.VIDEO_UNREADABLE, _NO_PYAV) from None
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


def count_video_frames(path: str) -> int:
  try:
    import av  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise Drop(DropReason.VIDEO_UNREADABLE, _NO_PYAV) from None
  try:
    with av.open(path) as container:
      stream = container.streams.video[0]
      if stream.frames:
        return int(stream.frames)
      return sum(1 for _ in container.decode(video=0))
  except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
    raise Drop(DropReason.VIDEO_UNREADABLE, str(e)) from None


def embedded_frames(files, folder: str) -> list[str]:
  """Frames `*_N.jpg` directly inside `folder` among a converted record's file names.

  The same choice and N order as `frame_folder`, over the names `folder + name`
  the converter embedded the folder's files under.
  """
  frames = [(int(m.group(1)), name) for name in files
            if name.startswith(folder) and "/" not in name[len(folder):]
            and (m := _FRAME_NUMBER.search(name))]
  if not frames:
    raise Drop(DropReason.VIDEO_UNREADABLE, f"no *_N.jpg frames in {folder}")
  return [name for _, name in sorted(frames)]
