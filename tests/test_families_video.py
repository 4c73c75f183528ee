"""Upstream's frame sampler (rand, middle, fpsX) on folders and real video files, decoding only
the frames a sample uses, and the bounds on what a video may cost.

Expected indices are upstream's rule worked by hand (the comments show the arithmetic);
expected pixels come from decoding every frame from the start (`video_files.decode_all`).
"""

import hashlib
import io
import json
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagel_grain.drops import Drop, DropReason
from bagel_grain.families import video
from bagel_grain.families.video import FrameSamplerArgs
from video_files import VideoSpec, decode_all, write_video

RAND, MIDDLE = FrameSamplerArgs(12, 8, "rand"), FrameSamplerArgs(12, 8, "middle")


def reason(call, *args, **kwargs):
  with pytest.raises(Drop) as e:
    call(*args, **kwargs)
  return e.value.reason


# --- the index rule ---------------------------------------------------------------------


def test_rand_takes_one_frame_per_interval():
  counts = set()
  for seed in range(200):
    rng = np.random.default_rng(seed)
    indices = video.frame_indices(video.draw_frame_count(RAND, rng), 100, RAND, rng)
    counts.add(len(indices))
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    assert all(0 <= i < 100 for i in indices)
  assert counts == set(range(8, 13))
  for seed in range(50):
    # 10 frames of 100: interval k is [10k, 10k + 10), upstream draws from range(10k, 10k + 9).
    indices = video.frame_indices(10, 100, RAND, np.random.default_rng(seed))
    assert all(10 * k <= i <= 10 * k + 8 for k, i in enumerate(indices))


def test_rand_falls_back_to_a_sorted_permutation_when_an_interval_is_too_short():
  # 8 of 12 frames: linspace gives bounds 0,1,3,4,6,7,9,10,12, so range(0, 0) is empty.
  seen = set()
  for seed in range(60):
    indices = video.frame_indices(8, 12, RAND, np.random.default_rng(seed))
    assert len(indices) == 8 and indices == sorted(set(indices))
    seen.update(indices)
  assert seen == set(range(12))  # per-interval draws could never pick frame 11


@pytest.mark.parametrize("t,vlen,expected", [
    # linspace(0, 48, 6) -> 0 9 19 28 38 48; middles (0+8)//2, (9+18)//2, ...
    (5, 48, [4, 13, 23, 32, 42]),
    # linspace(0, 30, 5) -> 0 7 15 22 30
    (4, 30, [3, 10, 18, 25]),
    # linspace(0, 20, 7) -> 0 3 6 10 13 16 20
    (6, 20, [1, 4, 7, 11, 14, 17]),
    # linspace(0, 60, 9) -> 0 7 15 22 30 37 45 52 60
    (8, 60, [3, 10, 18, 25, 33, 40, 48, 55]),
    # 3 frames for 5: one frame per interval, then padded with the last
    (5, 3, [0, 1, 2, 2, 2]),
    (4, 1, [0, 0, 0, 0]),
])
def test_middle_takes_each_intervals_middle_and_pads(t, vlen, expected):
  for seed in range(3):  # nothing random is drawn for the choice
    assert video.frame_indices(t, vlen, MIDDLE, np.random.default_rng(seed)) == expected


@pytest.mark.parametrize("sample,vlen,fps,expected", [
    # duration 2 s, one frame every 0.5 s at 0.25, 0.75, 1.25, 1.75 s -> x24
    ("fps2", 48, 24.0, [6, 18, 30, 42]),
    # one frame every 2 s at 1 s -> 24; the next (3 s) is past the end
    ("fps0.5", 48, 24.0, [24]),
    # a folder (fps 1): times 0.5 .. 9.5, rounded half to even, frame 10 dropped
    ("fps1", 10, 1.0, [0, 2, 2, 4, 4, 6, 6, 8, 8]),
    ("fps0.5", 10, 1.0, [1, 3, 5, 7, 9]),
    # times 1/6, 1/2, 5/6 s of a 1 s clip at 30 fps -> 5, 15, 25
    ("fps3", 30, 30.0, [5, 15, 25]),
])
def test_fps_takes_a_frame_per_step_without_padding(sample, vlen, fps, expected):
  args = FrameSamplerArgs(12, 8, sample)
  for t in (8, 12):  # the drawn count is not used
    assert video.frame_indices(t, vlen, args, np.random.default_rng(0), input_fps=fps) == expected


@pytest.mark.parametrize("sample", ["rand", "middle", "fps2"])
def test_the_count_is_drawn_first_in_every_mode(sample):
  """Every mode draws `t` once (upstream's randint); middle and fpsX draw nothing else."""
  args = FrameSamplerArgs(8, 4, sample)
  entries = [f"f_{i}.jpg" for i in range(100)]
  for seed in range(5):
    rng, twin = np.random.default_rng(seed), np.random.default_rng(seed)
    video.sample_folder(entries, args, rng)
    t = int(twin.integers(4, 9))
    if sample == "rand":
      video.frame_indices(t, 100, args, twin)
    assert rng.integers(1 << 30) == twin.integers(1 << 30)


def test_the_sample_mode_is_checked():
  for good in ("rand", "middle", "fps1", "fps0.5", "fps12.5"):
    assert video.check_sample_mode(good) == good
  for bad in ("uniform", "fps", "fps0", "fps-1", "fpsnan", "fpsinf", "FPS1", 3, None):
    with pytest.raises(ValueError, match="fps0.5"):
      video.check_sample_mode(bad)
  with pytest.raises(ValueError):
    FrameSamplerArgs(8, 4, "head")


def test_fps_on_a_clip_with_no_frame_rate_is_a_bad_record():
  args = FrameSamplerArgs(8, 4, "fps1")
  for fps in (0.0, float("nan"), float("inf")):
    assert reason(video.frame_indices, 4, 48, args, np.random.default_rng(0),
                  input_fps=fps) == DropReason.VIDEO_UNREADABLE


def test_too_many_fps_frames_are_refused_before_allocating():
  args = FrameSamplerArgs(8, 4, "fps1000")
  # 1e9 frames at 1e-3 fps: 1e15 sampling times, refused without building them.
  assert reason(video.frame_indices, 4, 10**9, args, np.random.default_rng(0), input_fps=1e-3,
                max_frames=4096) == DropReason.TOO_MANY_VIDEO_FRAMES
  # 48 sampling times are not too many for a cap of 48 (one frame falls past the end:
  # the last time is 47.5 frames in, rounded half to even to 48).
  assert len(video.frame_indices(4, 48, FrameSamplerArgs(8, 4, "fps24"), np.random.default_rng(0),
                                 input_fps=24.0, max_frames=48)) == 47


# --- frame folders ----------------------------------------------------------------------


def test_folder_entries_sort_by_upstreams_frame_number():
  assert [video.frame_number(n) for n in (
      "frame_12.jpg", "a_1_2.jpg", "frame_12xjpg", "frame_12.JPG", "frame_12.png", "12.jpg",
      "notes.txt")] == [12, 2, 12, -1, -1, -1, -1]
  listed = ["d/frame_10.jpg", "d/frame_9.jpg", "d/b.txt", "d/frame_1.jpg", "d/a.png"]
  # Unnumbered entries first (as -1), in name order; then by number, not by name.
  assert video.order_folder_entries(listed) == [
      "d/a.png", "d/b.txt", "d/frame_1.jpg", "d/frame_9.jpg", "d/frame_10.jpg"]


def test_a_folder_is_sampled_only_when_longer_than_the_count_and_never_padded():
  entries = [f"f_{i}.jpg" for i in range(3)]
  for seed in range(5):
    assert video.sample_folder(entries, MIDDLE, np.random.default_rng(seed)) == entries
    assert video.sample_folder([], RAND, np.random.default_rng(seed)) == []
  args = FrameSamplerArgs(5, 5, "middle")
  entries = [f"f_{i}.jpg" for i in range(48)]
  assert video.sample_folder(entries, args, np.random.default_rng(0)) == [
      entries[i] for i in (4, 13, 23, 32, 42)]
  # 5 entries for t = 5: all kept as they are (upstream samples only when vlen > t).
  assert video.sample_folder(entries[:5], args, np.random.default_rng(0)) == entries[:5]
  fps = FrameSamplerArgs(4, 4, "fps0.5")
  assert video.sample_folder(entries[:10], fps, np.random.default_rng(0)) == [
      entries[i] for i in (1, 3, 5, 7, 9)]


# --- video files ------------------------------------------------------------------------

SPECS = (
    VideoSpec("h264_bframes.mp4", frames=48, keyint=12, bframes=3),
    VideoSpec("h264_one_keyframe.mp4", size=(176, 144), frames=60, keyint=250, bframes=2),
    VideoSpec("h264_odd.mkv", size=(161, 97), frames=30, keyint=7, bframes=2, pix_fmt="yuv444p"),
    VideoSpec("vp9.webm", codec="libvpx-vp9", size=(161, 97), frames=30, keyint=10),
    VideoSpec("mpeg4.avi", codec="mpeg4", size=(322, 182), frames=20, keyint=6, bframes=1),
    VideoSpec("short.mp4", size=(64, 48), frames=3, keyint=12, bframes=0),
)
# The middle frames of each file for t = 8 (or t = 5 for 48 frames), worked as above.
MIDDLES = {"h264_bframes.mp4": (5, [4, 13, 23, 32, 42]),
           "h264_one_keyframe.mp4": (8, [3, 10, 18, 25, 33, 40, 48, 55]),
           "h264_odd.mkv": (4, [3, 10, 18, 25]),
           "vp9.webm": (4, [3, 10, 18, 25]),
           "mpeg4.avi": (6, [1, 4, 7, 11, 14, 17]),
           "short.mp4": (5, [0, 1, 2, 2, 2])}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
  """name -> (path, every frame decoded from the start)."""
  folder = tmp_path_factory.mktemp("videos")
  out = {}
  for spec in SPECS:
    path = write_video(folder, spec)
    frames = decode_all(path)
    assert len(frames) == spec.frames and frames[0].shape == (spec.size[1], spec.size[0], 3)
    out[spec.name] = (path, frames)
  return out


def pixels(images):
  return [np.asarray(image) for image in images]


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_a_file_is_indexed_by_its_packets(videos, name):
  spec = next(s for s in SPECS if s.name == name)
  index = video.probe_video(str(videos[name][0]))
  assert len(index) == spec.frames and index.fps == spec.rate
  assert index.keys[0] == 0 and list(index.pts) == sorted(set(index.pts))
  if spec.keyint < spec.frames and spec.codec == "libx264":
    assert len(index.keys) >= spec.frames // spec.keyint  # several places to seek to


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_middle_frames_of_a_file_are_upstreams(videos, name):
  path, reference = videos[name]
  t, expected = MIDDLES[name]
  args = FrameSamplerArgs(t, t, "middle")
  images, count = video.read_video_frames(str(path), args, np.random.default_rng(0))
  assert count == t == len(images)
  for got, i in zip(pixels(images), expected):
    np.testing.assert_array_equal(got, reference[i])


@pytest.mark.parametrize("sample", ["rand", "fps2", "fps24"])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_rand_and_fps_frames_of_a_file_equal_a_decode_from_the_start(videos, name, sample):
  path, reference = videos[name]
  args = FrameSamplerArgs(6, 3, sample)
  fps = video.probe_video(str(path)).fps
  for seed in range(3):
    rng = np.random.default_rng(seed)
    images, count = video.read_video_frames(str(path), args, np.random.default_rng(seed))
    expected = video.frame_indices(video.draw_frame_count(args, rng), len(reference), args, rng,
                                   input_fps=fps)
    assert count == len(expected) == len(images)
    assert all(np.array_equal(got, reference[i]) for got, i in zip(pixels(images), expected))
  if sample == "fps24" and len(reference) > 4:  # one time per frame, in the middle of each:
    assert expected[:4] == [0, 2, 2, 4]  # x.5 frames in, rounded half to even


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_seeking_gives_the_frames_a_decode_from_the_start_gives(videos, data):
  name = data.draw(st.sampled_from(["h264_bframes.mp4", "h264_odd.mkv", "vp9.webm",
                                    "mpeg4.avi"]))
  path, reference = videos[name]
  positions = data.draw(st.lists(st.integers(0, len(reference) - 1), min_size=1, max_size=8))
  got = pixels(video.decode_video_frames(str(path), positions))
  for image, i in zip(got, positions):
    np.testing.assert_array_equal(image, reference[i])


def test_a_frame_near_the_end_is_reached_from_its_keyframe(videos):
  """With 15 frames of budget, frame 47 of 48 is reachable only by seeking to its keyframe."""
  path, reference = videos["h264_bframes.mp4"]
  index = video.probe_video(str(path))
  runs, cost = video.plan_decoding(index, [47])
  assert runs == [video.DecodeRun(index.keys[-1], 47)] and cost == 48 - index.keys[-1] <= 15
  [image] = video.decode_video_frames(str(path), [47], max_frames=15)
  np.testing.assert_array_equal(np.asarray(image), reference[47])
  # Frames in one group are decoded on, not sought again; a later group seeks.
  k = index.keys
  runs, cost = video.plan_decoding(index, [k[1] + 1, k[1] + 3, k[2] + 1])
  assert runs == [video.DecodeRun(k[1], k[1] + 1), video.DecodeRun(None, k[1] + 3),
                  video.DecodeRun(k[2], k[2] + 1)]
  assert cost == 2 + 2 + 2
  # A clip with one keyframe decodes from the start: 60 frames is over a 15-frame budget.
  path, _ = videos["h264_one_keyframe.mp4"]
  assert reason(video.decode_video_frames, str(path), [59],
                max_frames=15) == DropReason.TOO_MANY_VIDEO_FRAMES


def test_frames_over_the_pixel_cap_are_refused_before_decoding(videos):
  path, _ = videos["h264_bframes.mp4"]
  assert reason(video.read_video_frames, str(path), MIDDLE, np.random.default_rng(0),
                max_pixels=320 * 240 - 1) == DropReason.TOO_MANY_PIXELS
  assert len(video.read_video_frames(str(path), MIDDLE, np.random.default_rng(0),
                                     max_pixels=320 * 240)[0]) == 12


def test_more_sampled_frames_than_the_cap_are_refused(videos):
  path, _ = videos["h264_bframes.mp4"]
  args = FrameSamplerArgs(8, 8, "fps100")  # 2 s at 100 per second: 200 frames
  assert reason(video.read_video_frames, str(path), args, np.random.default_rng(0),
                max_frames=199) == DropReason.TOO_MANY_VIDEO_FRAMES
  images, count = video.read_video_frames(str(path), args, np.random.default_rng(0),
                                          max_frames=200)
  # 200 times, 2 of them rounding to frame 48, past the end; each frame decoded once.
  assert count == 198 and len({id(image) for image in images}) == 48


def test_only_the_frames_taken_are_decoded(videos):
  path, reference = videos["h264_bframes.mp4"]
  seen = []

  def take(count):
    seen.append(count)
    return 2

  images, count = video.read_video_frames(str(path), FrameSamplerArgs(5, 5, "middle"),
                                          np.random.default_rng(0), take=take)
  assert seen == [5] and count == 5 and len(images) == 2
  assert all(np.array_equal(a, reference[i]) for a, i in zip(pixels(images), (4, 13)))


def _patched(data: bytes, box: bytes, offset: int, value) -> io.BytesIO:
  """`data` with the 32-bit big-endian field `offset` bytes after `box`'s type replaced."""
  out = bytearray(data)
  at = data.index(box) + 4 + offset
  struct.pack_into(">I", out, at, value(struct.unpack_from(">I", out, at)[0]))
  return io.BytesIO(bytes(out))


def test_containers_that_lie_are_dropped_not_decoded_without_end(videos, tmp_path):
  data = videos["h264_bframes.mp4"][0].read_bytes()
  # stts (time-to-sample) holds one entry: count 48 at offset 8, duration 512 at offset 12.
  for lie, said in ((_patched(data, b"stts", 8, lambda v: 10**9),  # claims 1e9 frames
                     DropReason.TOO_MANY_VIDEO_FRAMES),  # (refused from the header, unopened)
                    (_patched(data, b"stts", 12, lambda v: v * 100_000),  # frames of 28 min
                     DropReason.VIDEO_UNREADABLE),
                    (_patched(data, b"stsz", 8, lambda v: 10**9),  # 1e9 sizes in a table of 48
                     DropReason.VIDEO_UNREADABLE)):
    for args in (MIDDLE, FrameSamplerArgs(8, 8, "fps2")):
      lie.seek(0)
      assert reason(video.read_video_frames, lie, args, np.random.default_rng(0)) == said
  for junk in (data[: len(data) // 2], b"not a video", b""):
    assert reason(video.read_video_frames, io.BytesIO(junk), MIDDLE,
                  np.random.default_rng(0)) == DropReason.VIDEO_UNREADABLE


def test_a_rate_that_would_sample_without_end_is_refused(tmp_path):
  """12 frames said to last 1000 s each: fps2 would take 24,000 frames; refused unread."""
  path = write_video(tmp_path, VideoSpec("slow.mkv", size=(64, 48), frames=12,
                                         rate=Fraction(1, 1000)))
  assert video.probe_video(str(path)).fps == 0.001
  assert reason(video.read_video_frames, str(path), FrameSamplerArgs(8, 8, "fps2"),
                np.random.default_rng(0)) == DropReason.TOO_MANY_VIDEO_FRAMES
  assert video.read_video_frames(str(path), MIDDLE, np.random.default_rng(0))[1] == 12


def test_playlists_and_other_demuxers_are_refused(videos, tmp_path):
  """A file that would make ffmpeg open another file (or an address) is never parsed."""
  target = videos["h264_bframes.mp4"][0]
  for name, text in (("list.mp4", f"ffconcat version 1.0\nfile {target}\n"),
                     ("hls.mp4", f"#EXTM3U\n#EXTINF:2,\n{target}\n#EXT-X-ENDLIST\n")):
    (tmp_path / name).write_text(text)
    assert reason(video.read_video_frames, str(tmp_path / name), MIDDLE,
                  np.random.default_rng(0)) == DropReason.VIDEO_UNREADABLE


# --- upstream's reader: decord's frames, recorded by tools/video_goldens.py ---------------

GOLDEN = json.loads((Path(__file__).parent / "golden" / "video_frames.json").read_text())


@pytest.mark.parametrize("golden", GOLDEN["videos"], ids=lambda g: g["spec"]["name"])
def test_middle_frames_equal_decords(tmp_path, golden):
  """Same file, same count, same rate and, at upstream's middle indices, the same RGB bytes."""
  spec = VideoSpec(**{**golden["spec"], "size": tuple(golden["spec"]["size"])})
  path = write_video(tmp_path, spec)
  assert hashlib.sha256(path.read_bytes()).hexdigest() == golden["file_sha256"], (
      "the encoder wrote other bytes than when the goldens were made: "
      "run tools/video_goldens.py again")
  t = golden["t"]
  index = video.probe_video(str(path))
  assert (len(index), index.fps) == (golden["decord_len"], golden["decord_avg_fps"])
  images, count = video.read_video_frames(str(path), FrameSamplerArgs(t, t, "middle"),
                                          np.random.default_rng(0))
  assert count == t == len(golden["indices"])
  assert video.frame_indices(t, len(index), MIDDLE, np.random.default_rng(0)) == \
      golden["indices"]
  got = [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in pixels(images)]
  assert got == golden["frame_sha256"]
  assert list(np.asarray(images[0]).shape) == golden["frame_shape"]
