"""Writes tests/golden/video_frames.json: what decord (upstream's reader) gives for test videos.

Upstream reads a video file with decord: `len(VideoReader)` frames, `get_avg_fps()`,
and the RGB frames of `get_batch(indices)`. This script writes each test video with
PyAV (the same bytes `tests/video_files.py` writes: the file's sha256 is recorded and
checked by the test) and records decord's answers for upstream's `middle` indices.
decord is not a dependency; run this in a scratch environment:

    python3.11 -m venv /tmp/decord_venv
    /tmp/decord_venv/bin/pip install decord==0.6.0 av==18.1.0 numpy
    /tmp/decord_venv/bin/python tools/video_goldens.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from video_files import VideoSpec, write_video  # noqa: E402  pylint: disable=wrong-import-position

# (file, t): upstream's middle indices for t frames are worked out in the test's comments.
SPECS = (
    (VideoSpec("h264_bframes.mp4", frames=48, keyint=12, bframes=3), 5),
    (VideoSpec("h264_no_bframes.mp4", size=(320, 240), frames=48, keyint=12, bframes=0), 5),
    (VideoSpec("h264_one_keyframe.mp4", size=(176, 144), frames=60, keyint=250, bframes=2), 8),
    (VideoSpec("h264_720p.mp4", size=(1280, 720), frames=12, keyint=5, bframes=2), 4),
    (VideoSpec("h264_odd.mkv", size=(161, 97), frames=30, keyint=7, bframes=2,
               pix_fmt="yuv444p"), 4),
    # An odd width; an odd height in 4:2:0 is left out: decord's FFmpeg 4 converts its
    # chroma differently from PyAV's FFmpeg 8 (docs/design.md, section 10).
    (VideoSpec("vp9_odd_width.webm", codec="libvpx-vp9", size=(161, 98), frames=30,
               keyint=10), 4),
    (VideoSpec("vp9_even.webm", codec="libvpx-vp9", size=(320, 240), frames=48, keyint=12), 5),
    # Without B-frames: with them decord's get_batch on this AVI returns wrong frames (at
    # indices 1, 4, 7, 11: frames 1, 1, 0, 4), where PyAV gives what a decode from the start does.
    (VideoSpec("mpeg4.avi", codec="mpeg4", size=(322, 182), frames=20, keyint=6, bframes=0), 6),
    (VideoSpec("short.mp4", size=(64, 48), frames=3, keyint=12, bframes=0), 5),
)


def middle_indices(t: int, vlen: int) -> list[int]:
  """Upstream's `middle` rule, written out (see docs/design.md, section 10)."""
  n = min(t, vlen)
  bounds = np.linspace(0, vlen, n + 1).astype(int)
  indices = [int(a + b - 1) // 2 for a, b in zip(bounds[:-1], bounds[1:])]
  return indices + [indices[-1]] * (t - n)


def main() -> None:
  out = []
  with tempfile.TemporaryDirectory() as tmp:
    paths = [write_video(Path(tmp), spec) for spec, _ in SPECS]
    # decord brings its own FFmpeg libraries: imported before the files are written, it
    # breaks PyAV's VP9 encoder in the same process.
    import decord  # pylint: disable=import-outside-toplevel
    for (spec, t), path in zip(SPECS, paths):
      reader = decord.VideoReader(str(path), num_threads=1)
      indices = middle_indices(t, len(reader))
      frames = reader.get_batch(indices).asnumpy()
      out.append({
          "spec": dataclasses.asdict(spec), "t": t,
          "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
          "decord_len": len(reader), "decord_avg_fps": reader.get_avg_fps(),
          "indices": indices,
          "frame_sha256": [hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest()
                           for f in frames],
          "frame_shape": list(frames.shape[1:])})
      print(spec.name, len(reader), reader.get_avg_fps(), indices)
  target = ROOT / "tests" / "golden" / "video_frames.json"
  header = {"written_by": "tools/video_goldens.py", "decord": decord.__version__,
            "videos": out}
  target.write_text(json.dumps(header, indent=1) + "\n")
  print("wrote", target)


if __name__ == "__main__":
  main()
