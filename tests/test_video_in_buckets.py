"""Video files in a bucket decode the frames they give on local disk, bit for bit, through
ranged reads (`ranged_file.RangedFile`), never the whole object unless it is small (issue 28)."""

import collections
import errno
import io
import json
import shutil
import tempfile

import av
import numpy as np
import pytest

from bagel_grain import ranged_file
from bagel_grain.config import config_from_dict
from bagel_grain.drops import Drop, DropReason
from bagel_grain.errors import StorageUnavailableError
from bagel_grain.families import files, video
from bagel_grain.families.files import DiskFiles, opened_video
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from bagel_grain.ranged_file import RangedFile
from conftest import CONFIGS
from object_store import LocalObjectStore
from shipped_demo import shipped_demo_raw
from video_files import VideoSpec, write_video

# The codec cases of the video goldens: B-frames, VP9 in WebM, MPEG-4 part 2 in AVI, 3 frames;
# and a longer one (240 frames at 640x480, 470 KB).
SPECS = (VideoSpec("h264_bframes.mp4", frames=48, keyint=12, bframes=3),
         VideoSpec("vp9.webm", codec="libvpx-vp9", size=(161, 97), frames=30, keyint=10),
         VideoSpec("mpeg4.avi", codec="mpeg4", size=(322, 182), frames=20, keyint=6, bframes=1),
         VideoSpec("short.mp4", size=(64, 48), frames=3, keyint=12, bframes=0),
         VideoSpec("long.mp4", size=(640, 480), frames=240, keyint=24, bframes=2))
SAMPLERS = (FrameSamplerArgs(8, 8, "middle"), FrameSamplerArgs(6, 3, "rand"),
            FrameSamplerArgs(4, 4, "fps2"))


@pytest.fixture(scope="module")
def video_dir(tmp_path_factory, demo_dir):
  """The demo's video dataset, with a clip of each codec case and two rows naming each."""
  root = tmp_path_factory.mktemp("videos") / "video"
  shutil.copytree(demo_dir / "video", root)
  lines = (root / "video.jsonl").read_text().splitlines()
  for spec in SPECS:
    write_video(root / "clips", spec)
    for n, value in enumerate(("<video>\nWhat happens?", "Describe it. <video>")):
      lines.append(json.dumps({"id": f"{spec.name}_{n}", "video": f"clips/{spec.name}",
                               "conversations": [{"from": "human", "value": value},
                                                 {"from": "gpt", "value": "Colours change."}]}))
  (root / "video.jsonl").write_text("\n".join(lines) + "\n")
  return root


def _frames(source, args, seed):
  images, count = video.read_video_frames(source, args, np.random.default_rng(seed))
  return [np.asarray(image) for image in images], count


def _over_bytes(data: bytes, **kwargs) -> RangedFile:
  return RangedFile("clip.mp4", len(data), lambda o, n: data[o:o + n], **kwargs)


@pytest.mark.parametrize("buffer", [dict(), dict(block_bytes=4096, max_blocks=3, whole_bytes=0)],
                         ids=["default", "tiny-buffer"])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_ranged_reads_give_the_frames_of_the_file(video_dir, name, buffer):
  path = video_dir / "clips" / name
  data = path.read_bytes()
  for args in SAMPLERS:
    for seed in range(2):
      local = _frames(str(path), args, seed)
      ranged = _over_bytes(data, **buffer)
      got = _frames(ranged, args, seed)
      assert got[1] == local[1] and all(np.array_equal(a, b) for a, b in zip(got[0], local[0]))
      held = sum(len(b) for b in ranged._blocks.values())  # pylint: disable=protected-access
      assert held <= 16 * (256 << 10)


def test_a_small_object_is_read_in_one_request_a_large_one_in_ranges(video_dir):
  small = (video_dir / "clips" / "short.mp4").read_bytes()
  ranged = _over_bytes(small)
  _frames(ranged, SAMPLERS[0], 0)
  assert ranged.requests == 1 and ranged.bytes_read == len(small)
  assert ranged._spill._file is None  # pylint: disable=protected-access  # no temporary file
  # A buffer a quarter of the object: it is streamed through it (the packets demuxed
  # once, in runs of blocks), and the seek plan's ranges come back from the spill file.
  large = (video_dir / "clips" / "long.mp4").read_bytes()
  ranged = _over_bytes(large, whole_bytes=0, block_bytes=len(large) // 32, max_blocks=8)
  _frames(ranged, SAMPLERS[0], 0)
  assert 1 < ranged.requests < 32 and ranged.bytes_read == len(large)


@pytest.fixture(scope="module")
def noise_clip(tmp_path_factory):
  """5.1 MB of H.264 noise: over `WHOLE_BYTES`, so streamed through the default buffer."""
  path = tmp_path_factory.mktemp("noise") / "noise.mp4"
  rng = np.random.default_rng(0)
  with av.open(str(path), "w") as out:
    stream = out.add_stream("libx264", rate=24)
    stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
    stream.options = {"g": "24", "bf": "2", "preset": "ultrafast", "threads": "1"}
    for _ in range(120):
      image = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
      out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
    out.mux(stream.encode())
  assert path.stat().st_size > ranged_file.WHOLE_BYTES
  return path


def test_a_clip_over_the_buffer_is_fetched_once_and_decodes_as_on_disk(noise_clip, tmp_path,
                                                                        monkeypatch):
  """Demuxed whole, then sought and decoded (as PyAV reads it): each byte is fetched once
  (blocks that left the 4 MiB buffer come back from an unlinked temporary file), in a
  bounded number of requests, and the frames are the local file's."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  data = noise_clip.read_bytes()
  for head in (b"", data[:ranged_file.WHOLE_BYTES]):  # without and with read-ahead
    for args in SAMPLERS:
      local = _frames(str(noise_clip), args, 1)
      ranged = _over_bytes(data, head=head)
      got = _frames(ranged, args, 1)
      assert got[1] == local[1] and all(np.array_equal(a, b) for a, b in zip(got[0], local[0]))
      fetched = len(data) - len(head)
      assert fetched <= ranged.bytes_read <= 1.05 * fetched, (ranged.bytes_read, fetched)
      assert ranged.requests <= fetched // (2 << 20) + 6 and ranged.spill_error is None
      held = sum(len(b) for b in ranged._blocks.values())  # pylint: disable=protected-access
      assert held <= ranged_file.WHOLE_BYTES
      assert not list(tmp_path.iterdir())  # the temporary file has no name
      ranged.close()
      assert ranged._spill._file is None  # pylint: disable=protected-access


class _FullDisk(io.FileIO):
  """A temporary file on a disk that fills after `room` bytes."""
  room = 3 * ranged_file.BLOCK_BYTES

  def write(self, b):
    if self.tell() + len(b) > self.room:
      raise OSError(errno.ENOSPC, "No space left on device")
    return super().write(b)


@pytest.mark.parametrize("fault", ["no-tmpdir", "disk-full"])
def test_without_a_temporary_file_a_large_clip_is_read_again_not_dropped(
    noise_clip, tmp_path, monkeypatch, caplog, fault):
  """An unusable TMPDIR or a full disk: logged once per process, the blocks fetched again
  from the bucket as they are needed, the frames still the local file's."""
  monkeypatch.setattr(ranged_file, "_spill_warned", False)
  if fault == "no-tmpdir":
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
  else:
    monkeypatch.setattr(tempfile, "TemporaryFile",
                        lambda **_: _FullDisk(tmp_path / "spill", "w+"))
  data = noise_clip.read_bytes()
  local = _frames(str(noise_clip), SAMPLERS[0], 0)
  for _ in range(2):
    ranged = _over_bytes(data)
    got = _frames(ranged, SAMPLERS[0], 0)
    assert got[1] == local[1] and all(np.array_equal(a, b) for a, b in zip(got[0], local[0]))
    want = errno.ENOENT if fault == "no-tmpdir" else errno.ENOSPC
    assert ranged.spill_error.errno == want and ranged.bytes_read > 1.2 * len(data)
    ranged.close()
  warned = [r for r in caplog.records if r.name == ranged_file.__name__]
  assert len(warned) == 1 and "temporary file" in warned[0].getMessage()


def test_a_storage_failure_inside_pyav_is_raised_not_dropped(video_dir):
  """PyAV takes an exception in `read` for the end of the file: the failure is raised
  as it was, never a `video_unreadable` or a short index."""
  data = (video_dir / "clips" / "long.mp4").read_bytes()
  for fail_at in (0, 1, 3):
    calls = []

    def read_range(offset, length, fail_at=fail_at, calls=calls):
      calls.append(offset)
      if len(calls) > fail_at:
        raise StorageUnavailableError("long.mp4", "reset", 1.0, 3)
      return data[offset:offset + length]

    with pytest.raises(StorageUnavailableError):
      video.read_video_frames(RangedFile("long.mp4", len(data), read_range, whole_bytes=0,
                                         block_bytes=16 << 10, max_blocks=4),
                              SAMPLERS[0], np.random.default_rng(0))
    assert len(calls) == fail_at + 1  # not read on after the failure
  with pytest.raises(Drop) as e:  # a definite answer mid-read is that answer
    video.read_video_frames(RangedFile("a.mp4", len(data), _raises(Drop(
        DropReason.MISSING_FILE, "gone"))), SAMPLERS[0], np.random.default_rng(0))
  assert e.value.reason == DropReason.MISSING_FILE


def _raises(error):
  def read_range(offset, length):
    raise error
  return read_range


# --- on the S3 and GCS test servers ---------------------------------------------------------


@pytest.fixture(scope="module", params=["s3", "gcs"])
def bucket(request, video_dir):
  with LocalObjectStore(request.param) as store:
    yield store, store.upload(str(video_dir), "video")


def _env(store, monkeypatch):
  for name, value in store.environment().items():
    monkeypatch.setenv(name, value)


def test_objects_open_as_ranged_files_with_the_bounds_of_the_disk(bucket, video_dir, monkeypatch):
  store, root = bucket
  _env(store, monkeypatch)
  disk = DiskFiles(root)
  for spec in SPECS:
    path = disk.locate(f"clips/{spec.name}")
    with opened_video(disk, path, 1 << 30) as source:
      assert isinstance(source, RangedFile)
      got = _frames(source, SAMPLERS[1], 0)
    local = _frames(str(video_dir / "clips" / spec.name), SAMPLERS[1], 0)
    assert got[1] == local[1] and all(np.array_equal(a, b) for a, b in zip(got[0], local[0]))
  size = (video_dir / "clips" / "short.mp4").stat().st_size
  with pytest.raises(Drop) as e:
    disk.open_video(disk.locate("clips/short.mp4"), size - 1)
  assert e.value.reason == DropReason.FILE_TOO_LARGE
  with pytest.raises(Drop) as e:
    disk.open_video(disk.locate("clips/none.mp4"), size)
  assert e.value.reason == DropReason.MISSING_FILE


def _config(root: str, demo_dir):
  raw = shipped_demo_raw(demo_dir)
  raw["grouped_datasets"] = {"vlm_sft": {**raw["grouped_datasets"]["vlm_sft"],
                                         "dataset_names": ["demo_video"]}}
  raw["dataset_info"] = {"vlm_sft": {"demo_video": {"data_dir": root,
                                                    "jsonl_path": f"{root}/video.jsonl"}}}
  raw.update(num_epochs=1)
  return config_from_dict(raw, file="videos.yaml", base_dir=str(CONFIGS))


def _epoch(cfg, tokenizer, workers: int) -> tuple[list[dict], dict]:
  it = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers=workers))
  try:
    return list(it), pipeline_stats(it)["drops"]
  finally:
    it.close()


@pytest.fixture(scope="module")
def local_epoch(video_dir, demo_dir, demo_tokenizer):
  batches, drops = _epoch(_config(str(video_dir), demo_dir), demo_tokenizer, 0)
  keys = collections.Counter(k[3] for b in batches for row in b["sample_keys"] for k in row)
  lines = (video_dir / "video.jsonl").read_text().count("\n")
  assert len(keys) == lines == 4 + 2 * len(SPECS) and set(keys.values()) == {1}, keys
  return batches, drops


@pytest.mark.parametrize("workers", [0, 2])
def test_video_rows_in_a_bucket_give_the_local_batches_bit_for_bit(bucket, workers, demo_dir,
                                                                   demo_tokenizer, local_epoch,
                                                                   monkeypatch):
  store, root = bucket
  _env(store, monkeypatch)
  batches, drops = _epoch(_config(root, demo_dir), demo_tokenizer, workers)
  local, local_drops = local_epoch
  assert drops == local_drops
  assert len(batches) == len(local)
  for remote, here in zip(batches, local):
    for key in remote:
      if key == "sample_keys":
        assert [[k[3] for k in row] for row in remote[key]] == \
            [[k[3] for k in row] for row in here[key]]
      else:
        assert np.array_equal(remote[key], here[key]), key


def test_read_ahead_reads_a_small_objects_head_so_its_sample_makes_no_request(
    bucket, demo_dir, demo_tokenizer, monkeypatch):
  """Each row's clip (all under 4 MiB) is read ahead, size and bytes: the sample itself
  opens nothing and reads no range (one HEAD and one GET per clip, in a read-ahead thread)."""
  store, root = bucket
  _env(store, monkeypatch)
  heads, consumer = collections.Counter(), collections.Counter()
  read_head = ranged_file.read_head

  def counted_head(path):
    heads[path.rsplit("/", 1)[-1]] += 1
    return read_head(path)

  def counted_open(path):
    consumer[path.rsplit("/", 1)[-1]] += 1
    raise AssertionError("the consumer opened an object read ahead")

  monkeypatch.setattr(ranged_file, "read_head", counted_head)
  monkeypatch.setattr(files, "open_object", counted_open)
  _, drops = _epoch(_config(root, demo_dir), demo_tokenizer, 0)
  assert not drops.get("vlm_sft") and not consumer
  # Two rows name each clip: read once when both are ahead together, else once each.
  assert heads.keys() == {spec.name for spec in SPECS} | {"clip.mp4"}
  assert set(heads.values()) <= {1, 2}


def test_an_object_failing_its_first_reads_is_waited_out_not_dropped(video_dir, monkeypatch):
  """503s and reset connections on a video object's ranged reads are retried under the
  storage policy: the frames are the local ones, nothing is dropped."""
  with LocalObjectStore("s3") as store:
    root = store.upload(str(video_dir), "video")
    proxy = store.fault_proxy()
    for name, value in store.environment(proxy.port).items():
      monkeypatch.setenv(name, value)
    disk = DiskFiles(root)
    local = _frames(str(video_dir / "clips" / "long.mp4"), SAMPLERS[0], 0)
    for kind in ("503", "reset"):
      proxy.fault(kind, count=3, match="clips/long.mp4")
      with opened_video(disk, disk.locate("clips/long.mp4"), 1 << 30) as source:
        got = _frames(source, SAMPLERS[0], 0)
      assert got[1] == local[1] and all(np.array_equal(a, b) for a, b in zip(got[0], local[0]))
      assert proxy.counts()[f"fault_{kind}"] >= 3


def test_a_ranged_file_serves_any_read_from_its_head_and_ranges():
  """Reads anywhere, across blocks and past the end, give the object's bytes; a head
  read ahead is served without a request."""
  data = bytes(range(256)) * 400  # 102,400 bytes
  for head, whole, blocks in ((b"", 0, 4), (data[:5000], 0, 4), (data[:4096 * 3], 1 << 20, 4),
                              (b"", 1 << 20, 32), (data, 1 << 20, 32)):
    ranged = RangedFile("x.bin", len(data), lambda o, n: data[o:o + n], head=head,
                        block_bytes=4096, max_blocks=blocks, whole_bytes=whole)
    for offset, n in ((0, 10), (4090, 20), (50_000, 9000), (102_390, 100), (200_000, 5),
                      (len(head) - 1, 2), (0, -1)):
      offset = max(0, offset)
      ranged.seek(offset)
      want = data[offset:] if n < 0 else data[offset:offset + n]
      assert ranged.read(n) == want and ranged.tell() == offset + len(want)
    if blocks == 32:  # the object fits the buffer: read whole once, or never (the head)
      assert ranged.requests == (0 if head else 1)


def test_an_object_replaced_mid_sample_is_unreadable_not_mixed(video_dir, monkeypatch):
  """Ranges are pinned to the identity seen at open (S3: `If-Match` on the ETag): bytes of
  another upload are never mixed into a sample; the change is `unreadable_file`. (GCS pins
  the generation; the test emulator serves the newest whatever the generation asked.)"""
  with LocalObjectStore("s3") as store:
    root = store.upload(str(video_dir), "video")
    _env(store, monkeypatch)
    disk = DiskFiles(root)
    with opened_video(disk, disk.locate("clips/short.mp4"), 1 << 30) as source:
      store.upload_file(video_dir / "clips" / "vp9.webm", "video/clips/short.mp4")
      with pytest.raises(Drop) as e:
        _frames(source, SAMPLERS[0], 0)
    assert e.value.reason == DropReason.UNREADABLE_FILE
