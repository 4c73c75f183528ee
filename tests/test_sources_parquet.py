"""Parquet rows by row group: the footer index, row-group blocks, record ids, bad files."""

import pytest

from bagel_grain.errors import DatasetError
from bagel_grain.sources.parquet import ParquetRowSource, dataset_files
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
