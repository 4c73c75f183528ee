"""Parquet rows by row group: the footer index, row-group blocks, record ids, bad files."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bagel_grain.drops import Drop
from bagel_grain.errors import DatasetError
from bagel_grain.sources.parquet import ParquetRowSource, dataset_files
from bagel_grain.sources.records import ConcatSource, ShuffledRecords
from parquet_files import ALL_IDS, NON_EMPTY_ROW_GROUPS, two_files, write_parquet


@pytest.fixture
def files(tmp_path):
  return two_files(tmp_path)


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


def test_a_binary_cell_over_the_limit_drops_its_row_unread(tmp_path):
  path = str(tmp_path / "cells.parquet")
  big = b"\0" * 50_000  # compresses to almost nothing in the file
  pq.write_table(pa.table({
      "image": [b"small", big, b"tiny", None],
      "image_list": [[b"a", b"b"], [b"c"], [b"d", big], []],
      "captions": ["x" * 6000, "y", "z", "w"]}), path, compression="zstd", row_group_size=4)
  source = ParquetRowSource([path], ["image", "image_list", "captions"], max_cell_bytes=1000)
  assert source[0] == {"image": b"small", "image_list": [b"a", b"b"], "captions": "x" * 6000}
  assert source[3]["image"] is None  # a null is not a large cell; a long string is not binary
  for row, column in ((1, "image"), (2, "image_list")):
    with pytest.raises(Drop) as e:
      source[row]
    assert e.value.reason == "file_too_large" and f"#{row}" in str(e.value)
    assert column in str(e.value) and "50000 bytes" in str(e.value)
  # The cached row group never held the large values.
  assert source._cache.held_bytes < len(big)  # pylint: disable=protected-access
  records = ShuffledRecords(ConcatSource([source]), seed=0)
  errors = {r.record_id: r.error for r in (records[i] for i in range(4)) if r.error}
  assert {k.rsplit("#")[1]: v.reason for k, v in errors.items()} == {
      "1": "file_too_large", "2": "file_too_large"}


def test_cells_at_the_limit_are_served(tmp_path):
  path = str(tmp_path / "cells.parquet")
  pq.write_table(pa.table({"image": [b"a" * 1000, b"b" * 1001]}), path)
  served = ParquetRowSource([path], ["image"], max_cell_bytes=1000)
  assert served[0]["image"] == b"a" * 1000
  with pytest.raises(Drop):
    served[1]
  assert ParquetRowSource([path], ["image"])[1]["image"] == b"b" * 1001  # no limit given
