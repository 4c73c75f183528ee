"""Record sources: parquet rows by row group, JSONL lines by offset, epoch-wise blocked order."""

import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bagel_grain.errors import DatasetError
from bagel_grain.sources import jsonl
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import ParquetRowSource, dataset_files
from bagel_grain.sources.records import ConcatSource, ShuffledRecords, shard_blocks


def write_parquet(path, row_groups):
  """One row group per list of ids (an empty list writes an empty row group)."""
  schema = pa.schema([("id", pa.string()), ("payload", pa.binary())])
  with pq.ParquetWriter(path, schema) as writer:
    for ids in row_groups:
      writer.write_table(pa.table({"id": ids, "payload": [i.encode() for i in ids]},
                                  schema=schema))
  return str(path)


@pytest.fixture
def files(tmp_path):
  """a: 10 rows in groups of 3, 3, 3, 1; b: 4 rows, an empty group, then 2 rows."""
  a = write_parquet(tmp_path / "a.parquet",
                    [["a:0", "a:1", "a:2"], ["a:3", "a:4", "a:5"], ["a:6", "a:7", "a:8"], ["a:9"]])
  b = write_parquet(tmp_path / "b.parquet", [["b:0", "b:1", "b:2", "b:3"], [], ["b:4", "b:5"]])
  assert [pq.read_metadata(b).row_group(i).num_rows for i in range(3)] == [4, 0, 2]
  return a, b


ALL_IDS = [f"a:{i}" for i in range(10)] + [f"b:{i}" for i in range(6)]
NON_EMPTY_ROW_GROUPS = 6


def test_parquet_index_covers_every_row_once(files):
  a, b = files
  source = ParquetRowSource([a, b], ["id"])
  assert len(source) == 16
  assert [source[i]["id"] for i in range(16)] == ALL_IDS
  assert source[0] == {"id": "a:0"}  # only the requested columns
  # `file#row`, the row counted within its file (across the empty row group too).
  assert source.record_id(0) == f"{a}#0"
  assert source.record_id(9) == f"{a}#9"
  assert source.record_id(10) == f"{b}#0"
  assert source.record_id(15) == f"{b}#5"
  with pytest.raises(IndexError):
    source[16]


def test_parquet_index_order_reads_each_row_group_once(files):
  source = ParquetRowSource(list(files), ["id", "payload"])
  rows = [source[i] for i in range(len(source))]
  assert [r["payload"] for r in rows] == [i.encode() for i in ALL_IDS]
  assert source.row_group_reads == NON_EMPTY_ROW_GROUPS


def test_repeated_files_are_separate_records(files):
  a, _ = files
  source = ParquetRowSource([a, a], ["id"])
  assert len(source) == 20
  assert source[13]["id"] == "a:3"
  assert source.record_id(13) == f"{a}#3"


def _epoch(records, epoch):
  n = records.records_per_epoch
  return [records[i] for i in range(epoch * n, (epoch + 1) * n)]


def test_shuffled_epoch_is_blocked_by_row_group_and_visits_each_row_once(files):
  source = ParquetRowSource(list(files), ["id"])
  records = ShuffledRecords(ConcatSource([source]), seed=3)
  assert records.records_per_epoch == 16
  first = _epoch(records, 0)
  assert source.row_group_reads == NON_EMPTY_ROW_GROUPS  # more row groups than the cache holds
  ids = [r.fields["id"] for r in first]
  assert sorted(ids) == sorted(ALL_IDS)
  assert [r.index for r in first] == list(range(16)) and {r.epoch for r in first} == {0}
  # Each row group is one contiguous run of the epoch.
  groups = [(r.record_id.split("#")[0], _row_group_of(r.fields["id"])) for r in first]
  runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
  assert len(runs) == len(set(runs)) == NON_EMPTY_ROW_GROUPS

  second = _epoch(records, 1)
  assert {r.epoch for r in second} == {1}
  assert sorted(r.fields["id"] for r in second) == sorted(ALL_IDS)
  assert [r.fields["id"] for r in second] != ids


def _row_group_of(row_id):
  name, row = row_id.split(":")
  return (int(row) // 3) if name == "a" else (0 if int(row) < 4 else 2)


def test_order_is_a_function_of_the_seed(files):
  def order(seed):
    records = ShuffledRecords(ConcatSource([ParquetRowSource(list(files), ["id"])]), seed=seed)
    return [r.fields["id"] for r in _epoch(records, 0)]
  assert order(5) == order(5)
  assert order(5) != order(6)


def test_finite_epochs(files):
  records = ShuffledRecords(ConcatSource([ParquetRowSource(list(files), ["id"])]), seed=0,
                            num_epochs=2)
  assert len(records) == 32
  with pytest.raises(IndexError):
    records[32]


def test_concat_records_know_their_dataset(files):
  a, b = files
  records = ShuffledRecords(ConcatSource([ParquetRowSource([a], ["id"]),
                                          ParquetRowSource([b], ["id"])]), seed=1)
  for r in _epoch(records, 0):
    assert r.dataset == (0 if r.fields["id"].startswith("a") else 1)


def test_dataset_files_repeat_the_sorted_list(tmp_path):
  for name in ("c", "a", "b"):
    write_parquet(tmp_path / f"{name}.parquet", [["x"]])
  (tmp_path / "notes.txt").write_text("not a parquet file")
  a, b, c = (str(tmp_path / f"{n}.parquet") for n in "abc")
  assert dataset_files(str(tmp_path), None) == [a, b, c]
  assert dataset_files(str(tmp_path), 2) == [a, b]
  assert dataset_files(str(tmp_path), 7) == [a, b, c, a, b, c, a]


def test_dataset_files_without_parquet_is_an_error(tmp_path):
  with pytest.raises(DatasetError, match="no .parquet files"):
    dataset_files(str(tmp_path), None)


def test_missing_column_names_the_file_and_field(files):
  a, _ = files
  with pytest.raises(DatasetError, match="captions") as info:
    ParquetRowSource([a], ["id", "captions"])
  assert info.value.file == a and info.value.field == "captions"
  assert a in str(info.value)


@pytest.mark.parametrize("damage", ["delete", "garbage", "truncate"])
def test_file_damaged_mid_run_becomes_an_error_record(files, damage):
  a, b = files
  records = ShuffledRecords(ConcatSource([ParquetRowSource([a, b], ["id"])]), seed=0)
  if damage == "delete":
    os.remove(b)
  elif damage == "garbage":
    Path(b).write_bytes(b"this is not parquet" * 10)
  else:
    data = Path(b).read_bytes()
    Path(b).write_bytes(data[: len(data) // 2])
  results = _epoch(records, 0)  # no exception
  bad = [r for r in results if r.record_id.startswith(b + "#")]
  good = [r for r in results if r.record_id.startswith(a + "#")]
  assert len(bad) == 6 and len(good) == 10
  assert all(r.fields is None and r.error.reason == "unreadable_file" for r in bad)
  assert all(r.error is None for r in good)


# --- JSONL -----------------------------------------------------------------------------


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
  monkeypatch.setattr(jsonl, "_CHUNK", chunk)
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


# --- sharding by process -----------------------------------------------------------------


def test_process_shards_are_disjoint_and_cover_every_record(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f"line {i}\n" for i in range(11)))
  seen = []
  for process in range(3):
    records = ShuffledRecords(ConcatSource([JsonlLineSource(str(path))]), seed=9,
                              process_index=process, process_count=3)
    seen.append({r.fields for r in _epoch(records, 0)})
    assert len(seen[-1]) == records.records_per_epoch >= 3
  assert set.union(*seen) == {f"line {i}".encode() for i in range(11)}
  assert sum(len(s) for s in seen) == 11


def test_fewer_row_groups_than_processes_splits_rows(tmp_path):
  path = write_parquet(tmp_path / "small.parquet", [["r0", "r1", "r2"], ["r3", "r4", "r5"]])
  seen = []
  for process in range(4):
    records = ShuffledRecords(ConcatSource([ParquetRowSource([path], ["id"])]), seed=0,
                              process_index=process, process_count=4)
    seen.append([r.fields["id"] for r in _epoch(records, 0)])
  assert all(len(ids) >= 1 for ids in seen)
  assert sorted(sum(seen, [])) == ["r0", "r1", "r2", "r3", "r4", "r5"]


def test_shard_blocks_needs_a_record_per_process():
  # One block of two rows, two processes: the rows are split, one each.
  starts, sizes = shard_blocks([2], 1, 2)
  assert starts.tolist() == [1] and sizes.tolist() == [1]
  # Three blocks of 4, 1, 2 rows: contiguous shares.
  starts, sizes = shard_blocks([4, 1, 2], 0, 2)
  assert starts.tolist() == [0, 4] and sizes.tolist() == [4, 1]
  with pytest.raises(DatasetError):
    shard_blocks([2], 0, 3)
