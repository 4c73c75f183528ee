"""JSONL lines by byte offset: upstream's line splitting, shuffle and cut."""

import random

import pytest

from bagel_grain.sources import sidecar
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
