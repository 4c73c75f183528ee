"""The sidecar index: same records as a scan, no footer or line scan when fresh, stale refused."""

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bagel_grain.tooling import cli
from bagel_grain.config import load_config
from bagel_grain.configs import shipped_path
from bagel_grain.errors import DatasetError
from bagel_grain.pipeline import build_pipeline
from bagel_grain.sources import identity, parquet_footer, sidecar
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import dataset_source
from bagel_grain.sources.records import ConcatSource, ShuffledRecords
from parquet_files import write_parquet


@given(st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"")), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_line_starts_split_as_readlines_does(tmp_path_factory, data, chunk):
  path = tmp_path_factory.mktemp("lines") / "f.jsonl"
  path.write_bytes(data)
  old, sidecar._SCAN_CHUNK = sidecar._SCAN_CHUNK, chunk  # pylint: disable=protected-access
  try:
    starts = sidecar.scan_line_starts(str(path))
  finally:
    sidecar._SCAN_CHUNK = old  # pylint: disable=protected-access
  lines = [line.rstrip(b"\n") for line in data.splitlines(keepends=True)]
  assert starts.dtype == np.int64 and len(starts) == len(lines) + 1
  assert [data[a:b - 1] for a, b in zip(starts[:-1], starts[1:])] == lines


def test_stored_line_order_is_upstreams_shuffle():
  expected = list(range(1000))
  random.Random(7).shuffle(expected)
  assert sidecar.upstream_line_order(1000, 7).tolist() == expected


def _jsonl(tmp_path, n=50):
  path = tmp_path / "rows.jsonl"
  path.write_bytes(b"".join(f'{{"n": {i}}}{chr(13) if i % 3 == 0 else ""}\n'.encode()
                            for i in range(n)))
  return str(path)


def _records(source, **kwargs):
  records = ShuffledRecords(ConcatSource([source]), seed=5, **kwargs)
  return [(r.record_id, r.fields) for r in (records[i] for i in range(records.records_per_epoch))]


# A third of the lines reads every boundary at once; a tenth gathers them chunk by chunk.
@pytest.mark.parametrize("process_index, process_count", [(0, 3), (2, 3), (7, 10)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_indexed_jsonl_gives_the_scanned_records(tmp_path, process_index, process_count,
                                                 shuffle):
  path = _jsonl(tmp_path)
  kwargs = dict(num_used=40, shuffle_lines=shuffle, shuffle_seed=3)
  shard = dict(shard_index=process_index, shard_count=process_count)
  scanned = _records(JsonlLineSource(path, **kwargs), **shard)
  sidecar.write_jsonl_index(path, [3] if shuffle else [])
  indexed_source = JsonlLineSource(path, **kwargs)
  indexed = _records(indexed_source, **shard)
  assert indexed == scanned and len(indexed) == len(range(process_index, 40, process_count))


def test_a_shard_holds_sixteen_bytes_a_line_of_its_own_lines_only(tmp_path):
  path = _jsonl(tmp_path, 90)
  sidecar.write_jsonl_index(path, [1])
  source = JsonlLineSource(path, shuffle_lines=True, shuffle_seed=1)
  part = source.restrict(30, 60)
  arrays = (part._line, part._start, part._length)  # pylint: disable=protected-access
  assert all(len(a) == 30 for a in arrays)
  assert sum(a.itemsize for a in arrays) == 16


def test_jsonl_without_index_warns_once_past_the_threshold_and_a_stale_one_is_refused(
    tmp_path, caplog, monkeypatch):
  path = _jsonl(tmp_path)
  with caplog.at_level(logging.WARNING):
    JsonlLineSource(path)
  assert caplog.text == ""  # 50 lines: scanning them costs nothing worth a warning
  monkeypatch.setattr(sidecar, "WARN_LINES", 50)
  with caplog.at_level(logging.WARNING):
    JsonlLineSource(path)
    JsonlLineSource(path)
  assert caplog.text.count("no sidecar index") == 1 and "its 50 lines" in caplog.text
  sidecar.write_jsonl_index(path)
  with open(path, "ab") as f:
    f.write(b'{"n": 50}\n')
  with pytest.raises(DatasetError, match="changed since the index was written") as e:
    JsonlLineSource(path)
  assert e.value.file.endswith(".bagel_index.json")


def test_parquet_without_index_warns_once_past_the_threshold(tmp_path, caplog, monkeypatch):
  folder = _parquet_dir(tmp_path)
  with caplog.at_level(logging.WARNING):
    dataset_source(folder, None, ["id"])
  assert caplog.text == ""
  monkeypatch.setattr(sidecar, "WARN_FILES", 4)
  with caplog.at_level(logging.WARNING):
    dataset_source(folder, None, ["id"])
    dataset_source(folder, None, ["id"])
  assert caplog.text.count("no sidecar index") == 1 and "4 parquet files" in caplog.text


def _parquet_dir(tmp_path, files=4):
  folder = tmp_path / "pq"
  folder.mkdir()
  for f in range(files):
    write_parquet(folder / f"part-{f}.parquet",
                  [[f"{f}:{g}:{r}" for r in range(2 + g)] for g in range(3)])
  return str(folder)


@pytest.mark.parametrize("process_index", [0, 1])
def test_indexed_parquet_reads_no_footer_and_gives_the_same_records(tmp_path, monkeypatch,
                                                                   process_index):
  folder = _parquet_dir(tmp_path)
  shard = dict(shard_index=process_index, shard_count=2)
  footers = _records(dataset_source(folder, 6, ["id"]), **shard)
  sidecar.write_parquet_index(folder)
  _refuse_footers(monkeypatch)
  assert _records(dataset_source(folder, 6, ["id"]), **shard) == footers


def _no_footer(path, *args, **kwargs):
  raise AssertionError(f"footer of {path} read")


def _refuse_footers(monkeypatch):
  """A footer read at build fails the test (a row group's read of its own goes on)."""
  real = parquet_footer.read
  monkeypatch.setattr(parquet_footer, "read", lambda path, pin=None, *, at_build, **kw: (
      _no_footer(path) if at_build else real(path, pin, at_build=at_build, **kw)))


def test_parquet_info_spares_the_footers_of_other_processes_files(tmp_path, monkeypatch):
  folder = _parquet_dir(tmp_path)
  expected = _records(dataset_source(folder, None, ["id"]), shard_index=1, shard_count=2)
  info = tmp_path / "parquet_info.json"
  info.write_text(json.dumps({f"pq/part-{f}.parquet": {"num_row_groups": 3, "num_rows": 9}
                              for f in range(4)}))
  read = []
  real = parquet_footer.read
  monkeypatch.setattr(parquet_footer, "read", lambda p, pin=None, *, at_build, **kw: (
      read.append(p) or real(p, pin, at_build=at_build, **kw)))
  got = _records(dataset_source(folder, None, ["id"], str(info)), shard_index=1,
                 shard_count=2)
  assert got == expected
  assert sorted(os.path.basename(p) for p in read) == ["part-2.parquet", "part-3.parquet"]


def test_parquet_info_that_disagrees_with_a_footer_names_both(tmp_path):
  folder = _parquet_dir(tmp_path, files=1)
  info = tmp_path / "parquet_info.json"
  info.write_text(json.dumps({"part-0.parquet": {"num_row_groups": 2}}))
  with pytest.raises(DatasetError, match="parquet_info says 2 row groups") as e:
    ShuffledRecords(ConcatSource([dataset_source(folder, None, ["id"], str(info))]), seed=0)
  assert e.value.file == str(info)


@pytest.mark.parametrize("change", ["rewritten", "added", "removed"])
def test_a_stale_parquet_index_is_refused_naming_the_file(tmp_path, change):
  folder = _parquet_dir(tmp_path)
  sidecar.write_parquet_index(folder)
  if change == "rewritten":
    write_parquet(os.path.join(folder, "part-1.parquet"), [["x"]])
  elif change == "added":
    write_parquet(os.path.join(folder, "part-9.parquet"), [["x"]])
  else:
    os.remove(os.path.join(folder, "part-3.parquet"))
  with pytest.raises(DatasetError, match="bagel-grain index CONFIG") as e:
    dataset_source(folder, None, ["id"])
  assert e.value.file.endswith(sidecar.PARQUET_INDEX)


def test_index_command_then_the_demo_builds_without_scans_and_streams_the_same(
    tmp_path, demo_dir, demo_tokenizer, monkeypatch, capsys):
  data = tmp_path / "demo"
  shutil.copytree(demo_dir, data)

  def batches():
    it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, process_index=1,
                             process_count=2))
    try:
      return [next(it) for _ in range(3)]
    finally:
      it.close()

  config_path = tmp_path / "demo.yaml"
  config_path.write_text(_demo_yaml(data))
  cfg = load_config(config_path)
  before = batches()
  assert cli.main(["index", str(config_path)]) == 0
  assert "wrote" in capsys.readouterr().out
  _refuse_footers(monkeypatch)
  monkeypatch.setattr(sidecar, "scan_line_starts", _no_footer)
  after = batches()
  for a, b in zip(before, after, strict=True):
    for key in a:
      if key == "sample_keys":
        assert a[key] == b[key]
      else:
        assert np.array_equal(a[key], b[key]), key


def _demo_yaml(data) -> str:
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw["dataset_info"] = str(data / "dataset_info.yaml")
  raw["tokenizer_path"] = str(data / "tokenizer")
  return yaml.safe_dump(raw)


# -- integrity: every sidecar file is checked before its values are used --------------


def _zero_npy_values(path) -> None:
  """Overwrites an .npy file's values with zeros, keeping its header and length."""
  header_end = len(np.lib.format.magic(1, 0)) + 2
  data = bytearray(open(path, "rb").read())
  header_end += int.from_bytes(data[8:10], "little")
  data[header_end:] = bytes(len(data) - header_end)
  open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("damaged", ["shuffle", "lines"])
@pytest.mark.parametrize("process_index, process_count", [(0, 1), (1, 3)])
def test_a_zeroed_sidecar_array_is_refused_naming_it(tmp_path, damaged, process_index,
                                                      process_count):
  path = _jsonl(tmp_path, 90)
  sidecar.write_jsonl_index(path, [3])
  target = sidecar.shuffle_path(path, 3) if damaged == "shuffle" else path + ".bagel_lines.npy"
  _zero_npy_values(target)
  with pytest.raises(DatasetError, match="checksum") as e:
    source = JsonlLineSource(path, shuffle_lines=True, shuffle_seed=3)
    _records(source, shard_index=process_index, shard_count=process_count)
  assert e.value.file == target


def test_an_index_without_checksums_is_refused_with_the_command_to_rebuild_it(tmp_path):
  path = _jsonl(tmp_path)
  sidecar.write_jsonl_index(path, [3])
  meta = json.loads(open(path + ".bagel_index.json").read())
  old = {k: meta[k] for k in ("size", "mtime_ns", "lines", "shuffle_seeds")}  # format 1
  open(path + ".bagel_index.json", "w").write(
      json.dumps({"format": "bagel-grain jsonl index 1", **old}))
  with pytest.raises(DatasetError, match="re-run `bagel-grain index") as e:
    JsonlLineSource(path, shuffle_lines=True, shuffle_seed=3)
  assert e.value.file.endswith(".bagel_index.json")


def test_an_edited_parquet_index_is_refused(tmp_path):
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  folder = _parquet_dir(tmp_path)
  path = sidecar.write_parquet_index(folder)
  table = pa.ipc.open_file(path).read_all()
  rows = pa.array([[0] * len(r) for r in table.column("row_group_rows").to_pylist()],
                  pa.list_(pa.int64()))
  edited = table.set_column(table.schema.get_field_index("row_group_rows"), "row_group_rows", rows).replace_schema_metadata(
      table.schema.metadata)
  with pa.OSFile(path, "wb") as out, pa.ipc.new_file(out, edited.schema) as writer:
    writer.write_table(edited)
  with pytest.raises(DatasetError, match="checksum") as e:
    dataset_source(folder, None, ["id"])
  assert e.value.file == path


def test_index_files_are_the_same_bytes_from_whole_and_split_scans(tmp_path):
  path = _jsonl(tmp_path, 300)
  size = os.path.getsize(path)
  ident = identity.Identity(size, 1, md5="ab")
  whole = sidecar.jsonl_index_files(path, ident, sidecar.scan_line_starts(path), [3, 1])
  cuts = [0, 1, 17, 18, 500, size - 1, size]
  ends = [sidecar.line_ends(path, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
  split = sidecar.jsonl_index_files(path, ident, sidecar.line_starts_from_ends(ends, size),
                                    [1, 3])
  assert split == whole
