"""Video files whose headers or packets promise far more work than their bytes: each is refused
by a bound checked before FFmpeg or the demuxer spends it (issue 27, video rows)."""

import io
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagel_grain.config import config_from_dict
from bagel_grain.drops import Drop, DropReason
from bagel_grain.families import video, video_headers
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from conftest import CONFIGS
from hostile_videos import (fragmented_mp4, many_packets_mkv, many_streams_mkv,
                            mjpeg_avi_growing_frame, mjpeg_frame, mp4_claiming_samples,
                            mux_mjpeg)
from shipped_demo import shipped_demo_raw
from video_files import VideoSpec, decode_all, write_video

MIDDLE = FrameSamplerArgs(8, 8, "middle")


def reason(source, **bounds) -> DropReason | None:
  try:
    video.read_video_frames(source, MIDDLE, np.random.default_rng(0), **bounds)
  except Drop as e:
    return e.reason
  return None


class CountingFile(io.BytesIO):
  """A file that counts the bytes read from it."""

  read_bytes = 0

  def read(self, n=-1):
    data = super().read(n)
    self.read_bytes += len(data)
    return data


def test_a_stream_of_many_tiny_packets_is_refused_once_its_index_is_full(tmp_path):
  """20,000 packets, 64 frames allowed: the index stops at 16 x 64 packets, not at the end."""
  path = many_packets_mkv(tmp_path / "packets.mkv", 20_000)
  f = CountingFile(path.read_bytes())
  assert reason(f, max_frames=64) == DropReason.TOO_MANY_VIDEO_FRAMES
  assert f.read_bytes < path.stat().st_size / 4
  # The same file under a bound that holds it is indexed whole.
  assert len(video.probe_video(str(path), max_frames=20_000 // 16 + 1)) == 20_000


def test_packets_of_other_streams_count_too(tmp_path):
  """A stream beside the video cannot hide an unbounded number of packets."""
  path = tmp_path / "two.mkv"
  frame = mjpeg_frame()
  mux_mjpeg(path, "matroska", [[frame] * 8, [frame] + [b"\x00"] * 5000])
  assert reason(str(path), max_frames=16) == DropReason.TOO_MANY_VIDEO_FRAMES
  assert reason(str(path), max_frames=256) is None  # 5008 < 2 x 16 x 256


def test_an_mp4_claiming_millions_of_samples_is_refused_before_ffmpeg_opens_it(tmp_path,
                                                                             monkeypatch):
  source = write_video(tmp_path, VideoSpec("src.mp4", size=(64, 48), frames=24))
  lie = mp4_claiming_samples(source, tmp_path / "claims.mp4", 85_000_000)
  assert lie.stat().st_size == source.stat().st_size  # the claim costs no bytes

  def never(*args, **kwargs):
    raise AssertionError("FFmpeg opened a file whose header claims 85M samples")

  monkeypatch.setattr(video, "_open", never)
  assert reason(str(lie)) == DropReason.TOO_MANY_VIDEO_FRAMES
  assert reason(io.BytesIO(lie.read_bytes())) == DropReason.TOO_MANY_VIDEO_FRAMES
  monkeypatch.undo()
  # The claim is checked against the bound: the real file passes, a smaller lie too
  # (it is then FFmpeg's: a claim its packets do not fill is unreadable).
  assert reason(str(source)) is None
  small = mp4_claiming_samples(source, tmp_path / "small.mp4", 1000)
  assert reason(str(small)) == DropReason.VIDEO_UNREADABLE


def test_sample_tables_larger_than_their_box_are_unreadable(tmp_path, monkeypatch):
  source = write_video(tmp_path, VideoSpec("src.mp4", size=(64, 48), frames=24))
  data = bytearray(source.read_bytes())
  at = data.index(b"stco") + 4 + 4  # the chunk offsets' entry count
  data[at:at + 4] = (10**6).to_bytes(4, "big")
  monkeypatch.setattr(video, "_open", lambda *a, **k: pytest.fail("opened"))
  assert reason(io.BytesIO(bytes(data))) == DropReason.VIDEO_UNREADABLE


_UNDER_A_MEMORY_LIMIT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from bagel_grain.drops import Drop
    from bagel_grain.families import video
    with open("/proc/self/status") as f:
      vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), resource.RLIM_INFINITY))
    try:
      video.read_video_frames(sys.argv[1], video.FrameSamplerArgs(8, 8, "middle"),
                              np.random.default_rng(0))
      print("kept")
    except Drop as e:
      print(e.reason.value)
""")


def test_anmjpeg_frame_is_refused_by_its_jpeg_header_before_it_is_decoded(tmp_path):
  """Header and frame 1 say 64x48; frame 2 is a real 16000x16000 JPEG (256M pixels, 3 MB).
  Decoding it would take 256 MB; with 128 MB to spare the frame is still refused by size."""
  path = mjpeg_avi_growing_frame(tmp_path / "grow.avi")
  assert reason(str(path)) == DropReason.TOO_MANY_PIXELS
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  out = subprocess.run([sys.executable, "-c", _UNDER_A_MEMORY_LIMIT, str(path)], env=env,
                       capture_output=True, text=True, timeout=300, check=True)
  assert out.stdout.split()[-1] == "too_many_pixels", out.stderr[-2000:]
  assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY  # ours untouched


def test_a_container_of_many_streams_is_refused_before_they_are_probed(tmp_path):
  """A record needs one video stream; 1,000 (941 KB) are refused, 16 are read."""
  assert reason(str(many_streams_mkv(tmp_path / "many.mkv", 1000))) == \
      DropReason.VIDEO_UNREADABLE
  assert reason(str(many_streams_mkv(tmp_path / "17.mkv", video.MAX_STREAMS + 1))) == \
      DropReason.VIDEO_UNREADABLE
  assert reason(str(many_streams_mkv(tmp_path / "16.mkv", video.MAX_STREAMS))) is None


def test_hostile_videos_are_dropped_with_two_workers_within_a_short_element_timeout(
    tmp_path, demo_dir, demo_tokenizer):
  """The four files of issue 27 beside the demo's video rows, 2 workers, element_timeout_s 5:
  the epoch ends, every good row packed once, each hostile one dropped under its reason."""
  root = tmp_path / "video"
  shutil.copytree(demo_dir / "video", root)
  clips = root / "clips"
  source = write_video(tmp_path, VideoSpec("src.mp4", size=(64, 48), frames=24))
  hostile = {many_packets_mkv(clips / "packets.mkv", 1_000_000).name: "too_many_video_frames",
             mp4_claiming_samples(source, clips / "claims.mp4", 85_000_000).name:
                 "too_many_video_frames",
             mjpeg_avi_growing_frame(clips / "grows.avi").name: "too_many_pixels",
             many_streams_mkv(clips / "streams.mkv", 1000).name: "video_unreadable"}
  turns = [{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "!"}]
  with open(root / "video.jsonl", "a", encoding="utf-8") as f:
    for name in hostile:
      f.write(json.dumps({"video": f"clips/{name}", "conversations": turns}) + "\n")
  raw = shipped_demo_raw(demo_dir)
  raw["grouped_datasets"] = {"vlm_sft": {**raw["grouped_datasets"]["vlm_sft"],
                                         "dataset_names": ["demo_video"]}}
  raw["dataset_info"] = {"vlm_sft": {"demo_video": {"data_dir": str(root),
                                                    "jsonl_path": str(root / "video.jsonl")}}}
  raw.update(num_epochs=1, element_timeout_s=5)
  cfg = config_from_dict(raw, file="hostile-videos.yaml", base_dir=str(CONFIGS))
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=2))
  try:
    keys = [k[3] for batch in it for row in batch["sample_keys"] for k in row]
    drops = pipeline_stats(it)["drops"]["vlm_sft"]
  finally:
    it.close()
  assert sorted(keys) == [f"demo_video/video.jsonl:{n}" for n in range(1, 5)]
  expected = {}
  for reason_name in hostile.values():
    expected[reason_name] = expected.get(reason_name, 0) + 1
  assert {k: v for k, v in drops.items() if v} == expected


@pytest.fixture(scope="module")
def header_seeds(tmp_path_factory):
  folder = tmp_path_factory.mktemp("seeds")
  return (write_video(folder, VideoSpec("seed.mp4", size=(64, 48), frames=12)).read_bytes(),
          mjpeg_frame())


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_headers_give_an_answer_or_a_drop(header_seeds, data):
  """Our own header readers meet hostile bytes first: any mutation of a real MP4 or JPEG
  gives claims, a size, None or a Drop, never another exception."""
  mp4, jpeg = header_seeds
  for seed in (mp4, jpeg):
    out = bytearray(seed[:data.draw(st.integers(0, len(seed)))])
    for _ in range(data.draw(st.integers(0, 8))):
      if out:
        out[data.draw(st.integers(0, len(out) - 1))] = data.draw(st.integers(0, 255))
    try:
      video_headers.mp4_claims(io.BytesIO(bytes(out)), len(out), 1000)
    except Drop:
      pass
    video_headers.jpeg_size(bytes(out))
    video_headers.jpeg_size(memoryview(bytes(out)))


def test_a_fragment_claiming_millions_of_samples_is_refused_before_ffmpeg_reads_it(
    tmp_path, monkeypatch):
  """A fragmented MP4's run holds its samples' fields in the defaults: 85M samples claimed
  in 4 bytes; FFmpeg would make an index entry for each as it reached the fragment."""
  good = fragmented_mp4(tmp_path / "fragments.mp4")
  images, count = video.read_video_frames(str(good), MIDDLE, np.random.default_rng(0))
  reference = decode_all(good)
  assert count == 8 and len(reference) == 48
  assert np.array_equal(np.asarray(images[0]), reference[video.frame_indices(
      8, 48, MIDDLE, np.random.default_rng(0))[0]])
  lie = fragmented_mp4(tmp_path / "lie.mp4", claimed=85_000_000)
  monkeypatch.setattr(video, "_open", lambda *a, **k: pytest.fail("opened"))
  assert reason(str(lie)) == DropReason.TOO_MANY_VIDEO_FRAMES
