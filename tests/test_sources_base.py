"""The record source interface, and the lookup of an index among parts laid end to end."""

import numpy as np
import pytest
from array_record.python import array_record_module

from bagel_grain.sources import framing
from bagel_grain.sources.array_record import ArrayRecordSource
from bagel_grain.sources.base import PartOffsets, RecordSource
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources.records import ConcatSource
from parquet_files import write_parquet


def test_an_index_falls_in_its_part_and_empty_parts_are_skipped():
  parts = PartOffsets([3, 0, 2, 1])
  assert len(parts) == 6
  assert [parts.locate(i) for i in range(6)] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (3, 0)]
  assert parts.sizes.tolist() == [3, 0, 2, 1]


@pytest.mark.parametrize("index", [-1, 6, 100])
def test_an_index_outside_the_parts_is_an_index_error(index):
  with pytest.raises(IndexError):
    PartOffsets([3, 0, 2, 1]).locate(index)


def test_no_parts_hold_no_index():
  parts = PartOffsets([])
  assert len(parts) == 0 and parts.sizes.tolist() == []
  with pytest.raises(IndexError):
    parts.locate(0)


def test_every_source_offers_the_interface_the_shuffle_reads(tmp_path):
  lines = tmp_path / "rows.jsonl"
  lines.write_text("a\nb\n")
  table = write_parquet(tmp_path / "rows.parquet", [["r0", "r1"], ["r2"]])
  records = str(tmp_path / "rows.array_record")
  writer = array_record_module.ArrayRecordWriter(records, "group_size:1")
  writer.write(framing.encode({"id": "x"}))
  writer.close()
  sources = [JsonlLineSource(str(lines)), ParquetRowSource([table], ["id"]),
             ArrayRecordSource([records])]
  sources.append(ConcatSource(list(sources)))
  for source in sources:
    assert isinstance(source, RecordSource), type(source).__name__
    sizes = source.block_sizes()
    assert isinstance(sizes, np.ndarray) and int(sizes.sum()) == len(source)
    assert all(isinstance(source.record_id(i), str) for i in range(len(source)))
  assert [sources[-1][i] for i in range(6)] == [b"a", b"b", {"id": "r0"}, {"id": "r1"},
                                                {"id": "r2"}, {"id": "x"}]
