"""The two file stores: the disk under data_dir (and its rules), and a converted record."""

import json
import os

import pytest

from bagel_grain import fs
from bagel_grain.drops import Drop, DropReason
from bagel_grain.errors import StorageUnavailableError
from bagel_grain.families.files import DiskFiles, EmbeddedFiles
from bagel_grain.families.vlm import embed_files
from bagel_grain.sources.framing import LineWithFiles
from bagel_grain.storage import RetryPolicy
from vlm_files import write_vlm_files


@pytest.fixture
def data(tmp_path):
  return write_vlm_files(tmp_path)


def reason(call, *args):
  with pytest.raises(Drop) as e:
    call(*args)
  return e.value.reason


def test_disk_paths_stay_inside_data_dir(data, tmp_path):
  disk = DiskFiles(str(data))
  assert disk.locate("a.png") == str(data / "a.png")
  assert disk.locate("clip/") == str(data / "clip") + os.sep  # a folder stays a folder
  assert disk.locate("clip/../a.png") == str(data / "a.png")
  for outside in ("../outside.png", str(tmp_path / "outside.png"), "link.png",
                  "clip/../../outside.png", "gs://bucket/a.png"):
    assert reason(disk.locate, outside) == DropReason.PATH_OUTSIDE_DATA_DIR, outside
  for not_a_path in ("", 3, None, ["a.png"], "a\udc00.png"):
    assert reason(disk.locate, not_a_path) == DropReason.WRONG_TYPE, not_a_path


def test_remote_data_dir_paths_are_checked_without_touching_storage():
  disk = DiskFiles("gs://bucket/data")
  assert disk.locate("images/a.png") == "gs://bucket/data/images/a.png"
  assert reason(disk.locate, "images/../../secret.png") == DropReason.PATH_OUTSIDE_DATA_DIR


def test_disk_reads_and_refuses_what_is_not_there(data):
  disk = DiskFiles(str(data))
  assert disk.read(disk.locate("a.png")) == (data / "a.png").read_bytes()
  assert reason(disk.read, disk.locate("nope.png")) == DropReason.MISSING_FILE
  size = (data / "a.png").stat().st_size
  assert disk.open_video(disk.locate("a.png"), size) == str(data / "a.png")
  assert reason(disk.open_video, disk.locate("a.png"), size - 1) == DropReason.FILE_TOO_LARGE
  assert reason(disk.open_video, disk.locate("nope.mp4"), size) == DropReason.MISSING_FILE


def test_disk_frames_come_in_frame_number_order(data):
  # Every entry is a frame (upstream's rule); one without `_N.jpg` sorts first, as -1.
  (data / "clip" / "notes.txt").write_text("not a frame")
  frames = DiskFiles(str(data)).list_frames(str(data / "clip") + "/")
  assert [os.path.basename(f) for f in frames] == ["notes.txt"] + [
      f"frame_{n}.jpg" for n in range(1, 11)]


def test_a_missing_or_escaping_frame_folder_is_dropped(data, tmp_path):
  disk = DiskFiles(str(data))
  assert reason(disk.list_frames, str(data / "gone") + "/") == DropReason.MISSING_FILE
  (data / "empty").mkdir()
  assert disk.list_frames(str(data / "empty") + "/") == []  # no frames: the sample is text
  (data / "clip" / "frame_11.jpg").symlink_to(tmp_path / "outside.png")
  assert reason(disk.list_frames, str(data / "clip") + "/") == DropReason.PATH_OUTSIDE_DATA_DIR


def test_links_to_a_sibling_folder_inside_data_dir_are_followed(data):
  """Issue 27: a frame linking to another folder of data_dir stays inside it."""
  (data / "linked").mkdir()
  for n in (1, 2):
    (data / "linked" / f"frame_{n}.jpg").symlink_to(data / "clip" / f"frame_{n}.jpg")
  (data / "sibling").symlink_to(data / "clip", target_is_directory=True)
  disk = DiskFiles(str(data))
  frames = disk.list_frames(disk.locate("linked/"))
  assert [os.path.basename(f) for f in frames] == ["frame_1.jpg", "frame_2.jpg"]
  assert disk.read(frames[0]) == (data / "clip" / "frame_1.jpg").read_bytes()
  assert len(disk.list_frames(disk.locate("sibling/"))) == 10


def test_embedded_files_answer_from_the_record_only():
  record = LineWithFiles(b"{}", {"a.png": b"png", "clip/frame_2.jpg": b"2",
                                 "clip/frame_10.jpg": b"10", "clip/sub/frame_1.jpg": b"x",
                                 "v.mp4": b"video"},
                         {"link.png": DropReason.PATH_OUTSIDE_DATA_DIR,
                          "clip/frame_3.jpg": DropReason.MISSING_FILE})
  files = EmbeddedFiles(record)
  assert files.locate("a.png") == "a.png" and files.read("a.png") == b"png"
  assert reason(files.locate, "link.png") == DropReason.PATH_OUTSIDE_DATA_DIR
  assert reason(files.locate, "/etc/hostname") == DropReason.PATH_OUTSIDE_DATA_DIR
  assert reason(files.read, "nope.png") == DropReason.MISSING_FILE
  # A frame that could not be read still counts; one in a sub-folder is not the clip's.
  assert files.list_frames("clip/") == ["clip/frame_2.jpg", "clip/frame_3.jpg",
                                        "clip/frame_10.jpg"]
  assert reason(files.read, "clip/frame_3.jpg") == DropReason.MISSING_FILE
  assert files.list_frames("other/") == []
  assert files.open_video("v.mp4", 5).read() == b"video"
  assert reason(files.open_video, "v.mp4", 4) == DropReason.FILE_TOO_LARGE  # same bound
  assert reason(files.open_video, "nope.mp4", 5) == DropReason.MISSING_FILE


def test_the_converter_embeds_what_the_disk_store_reads(data):
  line = json.dumps({"image": ["a.png", "link.png", "nope.png", "a.png"],
                     "conversations": []}).encode()
  record = embed_files(line, str(data))
  assert record.line == line
  assert record.files == {"a.png": (data / "a.png").read_bytes()}
  assert record.file_errors == {"link.png": DropReason.PATH_OUTSIDE_DATA_DIR}  # nope: absent
  video = embed_files(json.dumps({"video": "clip/"}).encode(), str(data))
  disk = DiskFiles(str(data))
  on_disk = disk.list_frames(disk.locate("clip/"))
  assert EmbeddedFiles(video).list_frames("clip/") == [
      "clip/" + os.path.basename(f) for f in on_disk]


@pytest.mark.parametrize("error, verdict", [
    (FileNotFoundError(2, "Path does not exist 'bucket/data/a.png'"), DropReason.MISSING_FILE),
    (PermissionError(13, "AWS Error ACCESS_DENIED"), DropReason.FILE_NOT_READABLE),
    (OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7"),
     StorageUnavailableError),
    (OSError("google::cloud::Status(UNAVAILABLE: Retry policy exhausted"),
     StorageUnavailableError)])
def test_storage_answers_become_drops_only_when_definite(monkeypatch, error, verdict):
  # A network failure is waited out, then an error: never a drop, never `missing_file`.
  monkeypatch.setattr(fs, "read_file", lambda path, max_bytes: (_ for _ in ()).throw(error))
  disk = DiskFiles("s3://bucket/data", storage=RetryPolicy(timeout_s=0.05, first_wait_s=0.01))
  path = disk.locate("a.png")
  if verdict is StorageUnavailableError:
    with pytest.raises(StorageUnavailableError, match="s3://bucket/data/a.png"):
      disk.read(path)
  else:
    assert reason(disk.read, path) == verdict


def test_a_read_failing_a_few_times_then_answering_is_read(monkeypatch):
  failures = [OSError("AWS Error UNKNOWN (HTTP status 503)")] * 3

  def flaky(path, max_bytes):
    if failures:
      raise failures.pop()
    return b"pixels"

  monkeypatch.setattr(fs, "read_file", flaky)
  disk = DiskFiles("gs://bucket/data", storage=RetryPolicy(first_wait_s=0.0, longest_wait_s=0.0))
  assert disk.read(disk.locate("a.png")) == b"pixels" and not failures
