"""A group's records: epoch-wise blocked shuffle, datasets end to end, process shards."""

import os
from pathlib import Path

import numpy as np
import pytest

from bagel_grain.errors import DatasetError, StorageUnavailableError
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources.records import ConcatSource, EraStart, ShuffledRecords, shard_blocks
from bagel_grain.storage import RetryPolicy
from parquet_files import ALL_IDS, NON_EMPTY_ROW_GROUPS, two_files, write_parquet


@pytest.fixture
def files(tmp_path):
  return two_files(tmp_path)


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


class _Flaky:
  """A source of 4 records whose reads fail with `error` while `failures` lasts."""

  def __init__(self, error, failures):
    self.error, self.failures = error, failures

  def __len__(self):
    return 4

  def num_blocks(self):
    return 4

  def block_sizes(self):
    return np.ones(4, np.int64)

  def record_id(self, index):
    return f"s3://bucket/rows.jsonl:{index + 1}"

  def __getitem__(self, index):
    if self.failures:
      self.failures -= 1
      raise self.error
    return f"line {index}".encode()


def test_a_record_read_is_retried_through_transient_failures():
  source = _Flaky(OSError("AWS Error NETWORK_CONNECTION: curlCode: 56"), failures=3)
  records = ShuffledRecords(ConcatSource([source]), seed=0,
                            storage=RetryPolicy(first_wait_s=0.0, longest_wait_s=0.0))
  assert all(r.error is None for r in _epoch(records, 0)) and source.failures == 0


def test_a_record_whose_storage_stays_down_is_an_error_not_a_drop():
  source = _Flaky(OSError("AWS Error UNKNOWN (HTTP status 503)"), failures=10**6)
  records = ShuffledRecords(ConcatSource([source]), seed=0,
                            storage=RetryPolicy(timeout_s=0.05, first_wait_s=0.01))
  with pytest.raises(StorageUnavailableError, match=r"s3://bucket/rows.jsonl:\d"):
    records[0]


# --- sharding by logical shard -----------------------------------------------------------


def test_logical_shards_are_disjoint_and_cover_every_record(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f"line {i}\n" for i in range(11)))
  seen = []
  for process in range(3):
    records = ShuffledRecords(ConcatSource([JsonlLineSource(str(path))]), seed=9,
                              shard_index=process, shard_count=3)
    seen.append({r.fields for r in _epoch(records, 0)})
    assert len(seen[-1]) == records.records_per_epoch >= 3
  assert set.union(*seen) == {f"line {i}".encode() for i in range(11)}
  assert sum(len(s) for s in seen) == 11


def test_fewer_row_groups_than_shards_splits_rows(tmp_path):
  path = write_parquet(tmp_path / "small.parquet", [["r0", "r1", "r2"], ["r3", "r4", "r5"]])
  seen = []
  for process in range(4):
    records = ShuffledRecords(ConcatSource([ParquetRowSource([path], ["id"])]), seed=0,
                              shard_index=process, shard_count=4)
    seen.append([r.fields["id"] for r in _epoch(records, 0)])
  assert all(len(ids) >= 1 for ids in seen)
  assert sorted(sum(seen, [])) == ["r0", "r1", "r2", "r3", "r4", "r5"]


# --- records appended: a set that grows between epochs ------------------------------------


def _lines(records, epoch, per_epoch, first=0):
  return [records[first + epoch * per_epoch + i].fields for i in range(per_epoch)]


@pytest.mark.parametrize("shuffled", [False, True])
def test_a_grown_set_keeps_the_epochs_before_it_and_every_record_in_its_shard(tmp_path,
                                                                              shuffled):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f"line {i}\n" for i in range(10)))
  shuffle = dict(shuffle_lines=shuffled, shuffle_seed=4)
  old = [ShuffledRecords(ConcatSource([JsonlLineSource(str(path), **shuffle)]), seed=9,
                         shard_index=s, shard_count=3) for s in range(3)]
  before = [[_lines(r, e, r.records_per_epoch) for e in range(2)] for r in old]
  with path.open("a") as f:
    f.write("".join(f"line {i}\n" for i in range(10, 17)))
  grown_source = ConcatSource([JsonlLineSource(str(path), **shuffle).grown_from(10)])
  grown = [ShuffledRecords(grown_source, seed=9, shard_index=s, shard_count=3, num_epochs=4,
                           sets=[[(0, 10)]], starts=[EraStart(epoch=2)]) for s in range(3)]
  everything = {f"line {i}".encode() for i in range(17)}
  later = []
  for s, records in enumerate(grown):
    n = records.records_per_epoch
    assert n == old[s].records_per_epoch  # the set it started with, as it was
    assert [_lines(records, e, n) for e in range(2)] == before[s]  # the same order
    (first, epoch, per_epoch), = records.later_eras()
    assert (first, epoch) == (2 * n, 2) and records.era_starts() == [2]
    assert len(records) == 2 * n + 2 * per_epoch
    later.append([set(_lines(records, e, per_epoch, first)) for e in range(2)])
    assert later[-1][0] == later[-1][1] >= set(before[s][0])  # a record keeps its shard
    assert {records[first + i].epoch for i in range(per_epoch)} == {2}
  for e in range(2):  # each later epoch covers every record once
    assert set.union(*(x[e] for x in later)) == everything
    assert sum(len(x[e]) for x in later) == 17


@pytest.mark.parametrize("after, epoch", [(0, 0), (3, 1), (10, 1), (11, 2)])
def test_a_grown_set_starts_at_the_first_epoch_not_begun(tmp_path, after, epoch):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f"line {i}\n" for i in range(12)))
  records = ShuffledRecords(ConcatSource([JsonlLineSource(str(path))]), seed=0,
                            sets=[[(0, 10)]], starts=[EraStart(after=after)])
  assert records.era_starts() == [epoch]
  old = {f"line {i}".encode() for i in range(10)}
  for e in range(epoch):  # the epochs begun: the ten lines it started with
    assert {records[i].fields for i in range(e * 10, e * 10 + 10)} == old
  grown = [records[i] for i in range(epoch * 10, epoch * 10 + 12)]
  assert {r.epoch for r in grown} == {epoch} and len({r.fields for r in grown}) == 12


def test_shard_blocks_needs_a_record_per_shard():
  # One block of two rows, two shards: the rows are split, one each.
  starts, sizes = shard_blocks([2], 1, 2)
  assert starts.tolist() == [1] and sizes.tolist() == [1]
  # Three blocks of 4, 1, 2 rows: contiguous shares.
  starts, sizes = shard_blocks([4, 1, 2], 0, 2)
  assert starts.tolist() == [0, 4] and sizes.tolist() == [4, 1]
  with pytest.raises(DatasetError):
    shard_blocks([2], 0, 3)


def _array_bytes(obj, seen) -> int:
  """Bytes of the numpy arrays held by `obj` and the source objects under it."""
  if id(obj) in seen:
    return 0
  seen.add(id(obj))
  if isinstance(obj, np.ndarray):
    return obj.nbytes
  if isinstance(obj, (list, tuple, dict)):
    return sum(_array_bytes(v, seen) for v in (obj.values() if isinstance(obj, dict) else obj))
  if type(obj).__module__.startswith("bagel_grain.sources"):
    return sum(_array_bytes(v, seen) for v in vars(obj).values())
  return 0


def test_a_jsonl_share_holds_20_bytes_a_line_with_its_epoch_order(tmp_path):
  # 16 a line for the source (line number, start, length) and 4 for the epoch's
  # order; nothing per line for blocks of one line.
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(f"line {i}\n" for i in range(10_000)))
  records = ShuffledRecords(ConcatSource([JsonlLineSource(str(path))]), seed=9,
                            shard_index=1, shard_count=4)
  assert records[0].fields.startswith(b"line ")  # the share's lines and first order loaded
  assert records.records_per_epoch == 2_500
  assert _array_bytes(records, set()) <= 20 * 2_500 + 64
