"""Small parquet files with known row groups, for the source and shuffle tests."""

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path, row_groups):
  """One row group per list of ids (an empty list writes an empty row group)."""
  schema = pa.schema([("id", pa.string()), ("payload", pa.binary())])
  with pq.ParquetWriter(path, schema) as writer:
    for ids in row_groups:
      writer.write_table(pa.table({"id": ids, "payload": [i.encode() for i in ids]},
                                  schema=schema))
  return str(path)


def two_files(tmp_path):
  """a: 10 rows in groups of 3, 3, 3, 1; b: 4 rows, an empty group, then 2 rows."""
  a = write_parquet(tmp_path / "a.parquet",
                    [["a:0", "a:1", "a:2"], ["a:3", "a:4", "a:5"], ["a:6", "a:7", "a:8"], ["a:9"]])
  b = write_parquet(tmp_path / "b.parquet", [["b:0", "b:1", "b:2", "b:3"], [], ["b:4", "b:5"]])
  assert [pq.read_metadata(b).row_group(i).num_rows for i in range(3)] == [4, 0, 2]
  return a, b


ALL_IDS = [f"a:{i}" for i in range(10)] + [f"b:{i}" for i in range(6)]
NON_EMPTY_ROW_GROUPS = 6
