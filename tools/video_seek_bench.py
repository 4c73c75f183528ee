"""Time per video sample: our seeking decoder vs decoding every frame up to the last wanted one
(and vs decord's `get_batch`, upstream's reader, when a Python with decord is given).

    python tools/video_seek_bench.py                       # a 60 s 720p H.264 clip, 8 frames
    python tools/video_seek_bench.py --decord-python /tmp/decord_venv/bin/python

Each sample draws 8 frames with upstream's `rand` rule (seeded) and reads them from a
fresh open of the file, as a sample does: our time includes opening and indexing the
packets, decord's its own indexing. All three decode on one thread. The clip is written
first with PyAV (libx264, 30 fps, x264's default keyframe interval of 250 frames,
B-frames). Not a test: timings depend on the machine; run it on a quiet one (`uptime`
is printed before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bagel_grain.families import video  # noqa: E402  pylint: disable=wrong-import-position

DECORD_SCRIPT = """
import json, sys, time
import decord
path, samples = sys.argv[1], json.loads(sys.argv[2])
times = []
for indices in samples:
  start = time.perf_counter()
  reader = decord.VideoReader(path, num_threads=1)
  frames = reader.get_batch(indices).asnumpy()
  times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def write_clip(path: Path, seconds: int, size: tuple[int, int], rate: int, keyint: int) -> None:
  w, h = size
  x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
  y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
  rng = np.random.default_rng(0)
  with av.open(str(path), "w") as out:
    stream = out.add_stream("libx264", rate=rate)
    stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
    stream.options = {"g": str(keyint), "bf": "3", "preset": "veryfast", "crf": "23"}
    for i in range(seconds * rate):
      t = i / rate
      base = 0.5 + 0.5 * np.sin(2 * np.pi * (x * 3 + y * 2 + t * 0.3))
      frame = np.empty((h, w, 3), np.uint8)
      frame[..., 0] = (base * 255).astype(np.uint8)
      frame[..., 1] = ((1 - base) * 200).astype(np.uint8)
      frame[..., 2] = rng.integers(0, 30, (h, w), dtype=np.uint8) + 100
      cx = int((0.1 + 0.8 * (t / seconds)) * w)
      frame[h // 3: h // 3 + 80, max(cx - 40, 0): cx + 40] = (250, 250, 0)
      out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
    out.mux(stream.encode())


def decode_up_to_last(path: Path, indices: list[int]) -> list:
  """The baseline: decode from the start, every frame, until the last wanted one."""
  wanted, images = set(indices), {}
  with av.open(str(path)) as container:
    container.streams.video[0].codec_context.thread_count = 1  # as ours and decord's
    for i, frame in enumerate(container.decode(video=0)):
      if i in wanted:
        images[i] = frame.to_image()
      if i >= max(indices):
        break
  return [images[i] for i in indices]


def run_decord(python: str, path: Path, indices: list[int]) -> float:
  """decord's time for one sample (open + get_batch), measured in its own process."""
  out = subprocess.run([python, "-c", DECORD_SCRIPT, str(path), json.dumps([indices])],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])[0]


def timed(call) -> tuple[float, object]:
  start = time.perf_counter()
  result = call()
  return time.perf_counter() - start, result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seconds", type=int, default=60)
  parser.add_argument("--size", default="1280x720")
  parser.add_argument("--rate", type=int, default=30)
  parser.add_argument("--keyint", type=int, default=250)
  parser.add_argument("--frames", type=int, default=8)
  parser.add_argument("--samples", type=int, default=10)
  parser.add_argument("--decord-python", help="a Python that can import decord (optional)")
  parser.add_argument("--json", help="write the results here")
  parser.add_argument("--clip", help="the clip to write, or to reuse when it exists "
                      "(default: a temporary file)")
  args = parser.parse_args()
  print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
  print(f"cpus: {os.cpu_count()}")
  size = tuple(int(v) for v in args.size.split("x"))
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(args.clip) if args.clip else Path(tmp) / "clip.mp4"
    took = 0.0
    if not path.exists():
      took, _ = timed(lambda: write_clip(path, args.seconds, size, args.rate, args.keyint))
    index = video.probe_video(str(path))
    print(f"clip: {args.seconds} s {args.size} H.264 at {args.rate} fps, {len(index)} frames, "
          f"{len(index.keys)} keyframes, {path.stat().st_size / 2**20:.1f} MiB "
          f"(written in {took:.0f} s)")
    index_times = [timed(lambda: video.probe_video(str(path)))[0] for _ in range(5)]
    print(f"index pass alone (open + demux every packet, no decoding): median "
          f"{statistics.median(index_times):.3f} s")
    sampler = video.FrameSamplerArgs(args.frames, args.frames, "rand")
    samples, ours, baseline, decoded, decord_times = [], [], [], [], []
    for seed in range(args.samples):
      rng = np.random.default_rng(seed)
      indices = video.frame_indices(video.draw_frame_count(sampler, rng), len(index), sampler,
                                    rng, input_fps=index.fps)
      samples.append(indices)
      t_ours, (images, _) = timed(lambda s=seed: video.read_video_frames(
          str(path), sampler, np.random.default_rng(s)))
      t_base, reference = timed(lambda i=indices: decode_up_to_last(path, i))
      assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images, reference))
      ours.append(t_ours)
      baseline.append(t_base)
      if args.decord_python:  # interleaved with ours, so a busy machine slows all alike
        decord_times.append(run_decord(args.decord_python, path, indices))
      decoded.append(video.plan_decoding(index, indices)[1])
      print(f"  sample {seed}: last frame {max(indices)}, ours {t_ours:.3f} s "
            f"({decoded[-1]} frames decoded), decode-up-to-last {t_base:.3f} s "
            f"({max(indices) + 1} frames)"
            + (f", decord {decord_times[-1]:.3f} s" if decord_times else ""))
  rows = [("ours (seek to the keyframe before each frame)", ours),
          ("decode every frame up to the last wanted", baseline)]
  if decord_times:
    rows.append(("decord 0.6.0 VideoReader + get_batch", decord_times))
  print(f"\nper sample of {args.frames} frames, {args.samples} samples:")
  print(f"{'reader':48s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'x ours':>7s}")
  for name, times in rows:
    print(f"{name:48s} {statistics.median(times):9.3f} {min(times):7.3f} {max(times):7.3f} "
          f"{statistics.median(times) / statistics.median(ours):7.2f}")
  print(f"frames decoded per sample, ours: median {statistics.median(decoded):.0f}")
  print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
  if args.json:
    Path(args.json).write_text(json.dumps({"ours": ours, "baseline": baseline,
                                           "decord": decord_times, "decoded": decoded,
                                           "samples": samples}, indent=1))


if __name__ == "__main__":
  main()
