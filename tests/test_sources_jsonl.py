"""JSONL lines by byte offset: upstream's line splitting, shuffle and cut."""

import os
import pickle
import random

import pytest

from bagel_grain.drops import Drop, DropReason
from bagel_grain.sources import jsonl, sidecar
from bagel_grain.sources.jsonl import JsonlLineSource


def test_jsonl_offsets_with_crlf_blank_lines_and_no_final_newline(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_bytes(b'{"a": 1}\r\n\r\n{"b": "\xc3\xa9"}\n   \n{"c": 3}')
  source = JsonlLineSource(str(path))
  assert [source[i] for i in range(len(source))] == [
    b'{"a": 1}', b"", '{"b": "é"}'.encode(), b"   ", b'{"c": 3}']
  assert [source.record_id(i) for i in range(5)] == [f"{path}:{n}" for n in range(1, 6)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_jsonl_offsets_do_not_depend_on_read_chunks(tmp_path, monkeypatch, chunk):
  path = tmp_path / "rows.jsonl"
  path.write_bytes(b'{"a": 1}\r\n\r\nxy\n\nlast')
  monkeypatch.setattr(sidecar, "_SCAN_CHUNK", chunk)
  source = JsonlLineSource(str(path))
  assert [source[i] for i in range(len(source))] == [b'{"a": 1}', b"", b"xy", b"", b"last"]


def test_jsonl_final_newline_adds_no_record(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_bytes(b"one\ntwo\n")
  source = JsonlLineSource(str(path))
  assert [source[i] for i in range(len(source))] == [b"one", b"two"]


def test_jsonl_shuffle_and_cut_match_upstream_readlines(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f'{{"n": {i}}}\n' for i in range(40)))
  source = JsonlLineSource(str(path), num_used=15, shuffle_lines=True, shuffle_seed=123)
  # Upstream: lines = f.readlines(); random.seed(seed); random.shuffle(lines); lines[:n].
  with open(path) as f:
    lines = f.readlines()
  random.Random(123).shuffle(lines)
  expected = [line.rstrip("\n") for line in lines[:15]]
  assert len(source) == 15
  assert [source[i].decode() for i in range(15)] == expected
  # Record ids keep the line's place in the file.
  assert all(source.record_id(i) == f"{path}:{int(expected[i][6:-1]) + 1}" for i in range(15))


def test_jsonl_cut_without_shuffle_keeps_the_first_lines(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("a\nb\nc\nd\n")
  source = JsonlLineSource(str(path), num_used=2)
  assert [source[i] for i in range(len(source))] == [b"a", b"b"]


# --- a file that changes while the stream runs: every process drops its lines ----------


def test_a_deleted_file_drops_its_lines_in_the_process_that_had_it_open(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f'{{"n": {i}}}\n' for i in range(5)))
  source = JsonlLineSource(str(path))
  assert source[0] == b'{"n": 0}'  # opened
  worker_copy = pickle.loads(pickle.dumps(source))  # what a worker gets: not yet opened
  path.unlink()
  with pytest.raises(Drop, match=r"rows\.jsonl was deleted while the stream ran") as e:
    source[1]
  assert e.value.reason == DropReason.UNREADABLE_FILE
  with pytest.raises(FileNotFoundError):  # records.py counts it as unreadable_file too
    worker_copy[1]


@pytest.mark.parametrize("opened_before", [True, False])
def test_a_file_rewritten_in_place_drops_its_lines(tmp_path, opened_before):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"n": 0}\n{"n": 1}\n')
  source = JsonlLineSource(str(path))
  if opened_before:
    assert source[0] == b'{"n": 0}'
  stat = path.stat()
  path.write_text('{"n": 7}\n{"n": 8}\n')  # same size: only the time tells
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
  with pytest.raises(Drop, match=r"rows\.jsonl changed since the stream was built") as e:
    source[1]
  assert e.value.reason == DropReason.UNREADABLE_FILE


def test_an_unchanged_file_reads_through_a_pickled_copy(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"n": 0}\n{"n": 1}\n')
  source = pickle.loads(pickle.dumps(JsonlLineSource(str(path))))
  assert [source[i] for i in range(2)] == [b'{"n": 0}', b'{"n": 1}']


def test_a_bom_at_the_start_is_kept_for_the_family_to_accept(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_bytes(b'\xef\xbb\xbf{"n": 0}\n{"n": 1}\n')
  assert JsonlLineSource(str(path))[0] == b'\xef\xbb\xbf{"n": 0}'


@pytest.mark.parametrize("mount", ["ext4", "fuse.gcsfuse"])
def test_a_file_on_a_mount_is_checked_once_a_second_not_once_a_line(tmp_path, monkeypatch,
                                                                     mount):
  # On gcsfuse or NFS an fstat may be a request to the server: at most one a second per
  # file there; on a local file system one a line (about 10 us), as before.
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f'{{"n": {i:02d}}}\n' for i in range(50)))
  monkeypatch.setattr(jsonl, "_mounts", lambda: [("/", "ext4"), (str(tmp_path), mount)])
  clock = [100.0]
  monkeypatch.setattr(jsonl.time, "monotonic", lambda: clock[0])
  stats = []
  real_fstat = os.fstat
  monkeypatch.setattr(jsonl.os, "fstat", lambda fd: stats.append(fd) or real_fstat(fd))
  source = JsonlLineSource(str(path))
  assert [source[i] for i in range(40)] == [f'{{"n": {i:02d}}}'.encode() for i in range(40)]
  assert len(stats) == (1 if mount.startswith("fuse") else 41)  # at open, then per line
  before = path.stat()
  path.write_text("".join(f'{{"n": {i + 50:02d}}}\n' for i in range(50)))  # same size
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
  clock[0] += jsonl.MOUNT_CHECK_S
  with pytest.raises(Drop, match="changed since the stream was built"):
    source[40]
