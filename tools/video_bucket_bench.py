"""Requests and bytes read per video sample from a bucket, against the file's size.

    python tools/video_bucket_bench.py            # S3 and GCS test servers, 4 samples a clip

Writes test clips (the codec cases of tests/test_video_in_buckets.py, and two of noise,
5.1 MB and 10.3 MB, larger than the 4 MiB buffer), uploads them to the project's S3
server and GCS emulator (tests/object_store/, on 127.0.0.1), and reads samples as the VLM family
does (`DiskFiles.open_video`, no read-ahead: every request is the sample's own). The
requests are counted by a fault proxy in front of the server (no fault injected): each
sample's HEAD/metadata requests and ranged GETs; the bytes are those the ranged reads
returned. Needs the `test` extra. Not a test: the figures depend on the encoder, not on
timing, so they are stable; no time is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import av
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
# pylint: disable=wrong-import-position
from bagel_grain.families.files import DiskFiles, opened_video  # noqa: E402
from bagel_grain.families.video import FrameSamplerArgs, read_video_frames  # noqa: E402
from object_store import LocalObjectStore  # noqa: E402
from video_files import VideoSpec, write_video  # noqa: E402

SPECS = (VideoSpec("short.mp4", size=(64, 48), frames=3, keyint=12, bframes=0),
         VideoSpec("h264_bframes.mp4", frames=48, keyint=12, bframes=3),
         VideoSpec("vp9.webm", codec="libvpx-vp9", size=(161, 97), frames=30, keyint=10),
         VideoSpec("mpeg4.avi", codec="mpeg4", size=(322, 182), frames=20, keyint=6, bframes=1),
         VideoSpec("long.mp4", size=(640, 480), frames=240, keyint=24, bframes=2))


def write_noise_clip(path: Path, frames: int = 120, size=(320, 240)) -> Path:
  """An H.264 clip of noise (incompressible): larger than the read buffer."""
  rng = np.random.default_rng(0)
  with av.open(str(path), "w") as out:
    stream = out.add_stream("libx264", rate=24)
    stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
    stream.options = {"g": "24", "bf": "2", "preset": "ultrafast", "threads": "1"}
    for _ in range(frames):
      image = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
      out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
    out.mux(stream.encode())
  return path


def measure(kind: str, folder: Path, names: list[str], samples: int) -> list[dict]:
  rows = []
  with LocalObjectStore(kind) as store:
    root = store.upload(str(folder), "clips")
    proxy = store.fault_proxy()
    os.environ.update(store.environment(proxy.port))
    files = DiskFiles(root)
    for name in names:
      size = (folder / name).stat().st_size
      before = proxy.counts()
      read = 0
      for seed in range(samples):
        args = FrameSamplerArgs(8, 8, "middle") if seed == 0 else FrameSamplerArgs(8, 4, "rand")
        with opened_video(files, files.locate(name), 1 << 30) as source:
          read_video_frames(source, args, np.random.default_rng(seed))
          read += source.bytes_read
      after = proxy.counts()
      requests = {k[len("requests_"):]: (after[k] - before.get(k, 0)) / samples for k in after
                  if k.startswith("requests_") and after[k] != before.get(k, 0)}
      rows.append({"store": kind, "file": name, "file_bytes": size,
                   "requests_per_sample": requests,
                   "bytes_per_sample": round(read / samples),
                   "bytes_over_file": round(read / samples / size, 2)})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--samples", type=int, default=4)
  parser.add_argument("--stores", default="s3,gcs")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="video_bucket_bench_") as tmp:
    folder = Path(tmp)
    for spec in SPECS:
      write_video(folder, spec)
    write_noise_clip(folder / "noise.mp4")
    write_noise_clip(folder / "noise_long.mp4", frames=240)
    names = [s.name for s in SPECS] + ["noise.mp4", "noise_long.mp4"]
    rows = []
    for kind in args.stores.split(","):
      rows += measure(kind, folder, names, args.samples)
  for row in rows:
    print(json.dumps(row))
  return 0


if __name__ == "__main__":
  sys.exit(main())
