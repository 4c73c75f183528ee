"""Parquet rows by row group: the footer index, row-group blocks, record ids, bad files."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lying_parquet
from bagel_grain.drops import Drop, DropReason
from bagel_grain.errors import DatasetError
from bagel_grain.sources import sidecar
from bagel_grain.sources.parquet import (ParquetRowSource, dataset_catalog, dataset_files,
                                         dataset_source)
from bagel_grain.sources.parquet_footer import MAX_ROWS_PER_BYTE
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


# --- files that lie: footers whose counts cannot be true, files rewritten mid-run --------


@pytest.mark.parametrize("claimed", [10**7, 10**9])
def test_a_footer_claiming_more_rows_than_its_columns_hold_is_refused(tmp_path, claimed):
  path = write_parquet(tmp_path / "lie.parquet", [["a", "b", "c", "d"]])
  lying_parquet.claim_rows(path, 0, claimed)
  with pytest.raises(DatasetError, match=f"row group 0 claims {claimed} rows, but its column "
                     "'id' holds 4 values") as e:
    ParquetRowSource([path], ["id"])
  assert e.value.file == path
  with pytest.raises(DatasetError, match="footer cannot be true"):
    sidecar.write_parquet_index(str(tmp_path))  # `bagel-grain index` refuses it too


def test_a_footer_lying_alike_everywhere_is_refused_by_its_size(tmp_path):
  path = write_parquet(tmp_path / "lie.parquet", [["a", "b", "c", "d"]])
  lying_parquet.claim_rows(path, 0, 10**7, consistent=True)
  with pytest.raises(DatasetError, match=r"claims 10000000 rows in \d+ bytes of column chunks,"
                     f" more than {MAX_ROWS_PER_BYTE} rows a byte") as e:
    ParquetRowSource([path], ["id"])
  assert e.value.file == path


def test_a_footer_whose_total_disagrees_with_its_row_groups_is_refused(tmp_path):
  path = write_parquet(tmp_path / "lie.parquet", [["a", "b"], ["c"]])
  body, footer = lying_parquet.read_footer(path)
  next(f for f in footer if f[0] == 3)[2] = 10**9  # FileMetaData.num_rows
  lying_parquet.write_footer(path, body, footer)
  with pytest.raises(DatasetError, match="row groups hold 3 rows in all, its footer says "
                     "1000000000"):
    ParquetRowSource([path], ["id"])


def test_rows_a_plausible_lying_footer_claims_are_dropped_naming_the_file(files, tmp_path):
  a, _ = files
  path = write_parquet(tmp_path / "lie.parquet", [["x0", "x1", "x2", "x3"]])
  lying_parquet.claim_rows(path, 0, 40, consistent=True)  # passes every footer check
  source = ParquetRowSource([a, path], ["id"])
  assert len(source) == 50
  assert [source[10 + i]["id"] for i in range(4)] == ["x0", "x1", "x2", "x3"]
  for i in range(14, 50):
    with pytest.raises(Drop) as e:
      source[i]
    assert e.value.reason == DropReason.UNREADABLE_FILE
    assert str(e.value.dropped.detail).startswith(f"{path} row group 0 holds 4 rows, 40 were "
                                                  "indexed")
  assert source.row_group_reads == 1  # the short row group was read once, not per row


def test_a_file_rewritten_shorter_mid_run_drops_the_rows_it_lost(files):
  a, _ = files  # row groups of 3, 3, 3, 1 rows
  source = ParquetRowSource([a], ["id"], cache_bytes=0)
  assert len(source) == 10  # indexed
  write_parquet(a, [["new:0", "new:1"]])  # rewritten in place: one row group of 2 rows
  assert [source[i]["id"] for i in range(2)] == ["new:0", "new:1"]
  for index, detail in ((2, f"{a} row group 0 holds 2 rows, 3 were indexed"),
                        (3, f"{a} row group 1: the file has 1 row groups now"),
                        (9, f"{a} row group 3: the file has 1 row groups now")):
    with pytest.raises(Drop) as e:
      source[index]
    assert e.value.reason == DropReason.UNREADABLE_FILE
    assert e.value.dropped.detail.startswith(detail)


def test_a_rewritten_file_becomes_drops_in_the_stream_not_an_error(files):
  a, b = files
  dataset = ShuffledRecords(ConcatSource([ParquetRowSource([a, b], ["id"], cache_bytes=0)]),
                            seed=3)
  first = dataset[0]
  assert first.error is None
  write_parquet(a, [["new:0", "new:1"]])
  write_parquet(b, [["new:0"]])
  records = [dataset[i] for i in range(1, dataset.records_per_epoch)]
  dropped = [r for r in records if r.error is not None]
  # Served: rows that still exist, or rows of the row group in hand (read before); its
  # group is at most 4 rows and 3 rows still exist.
  in_hand = {"a": [["a:0", "a:1", "a:2"], ["a:3", "a:4", "a:5"], ["a:6", "a:7", "a:8"],
                   ["a:9"]], "b": [["b:0", "b:1", "b:2", "b:3"], ["b:4", "b:5"]]}
  group = next(g for g in in_hand[first.fields["id"][0]] if first.fields["id"] in g)
  served = {r.fields["id"] for r in records if r.error is None}
  assert served <= {"new:0", "new:1"} | set(group)
  assert len(dropped) >= 16 - 1 - 3 - (len(group) - 1)
  assert {r.error.reason for r in dropped} == {DropReason.UNREADABLE_FILE}
  assert all(r.error.detail.startswith((a, b)) for r in dropped)


def test_an_index_claiming_more_rows_than_its_file_can_hold_is_refused(tmp_path):
  path = write_parquet(tmp_path / "a.parquet", [["a", "b", "c", "d"]])
  # An index whose checksum holds (written by a writer that believed a lying footer).
  files = sidecar.list_parquet_files(str(tmp_path))
  lying = sidecar.ParquetFileFacts(["id"], np.array([10**9]))
  index = tmp_path / sidecar.PARQUET_INDEX
  index.write_bytes(sidecar.parquet_index_bytes(files, [lying]))
  with pytest.raises(DatasetError, match=f"the sidecar index says 1000000000 rows for {path}, "
                     r"a file of \d+ bytes") as e:
    dataset_catalog(str(tmp_path), None, ["id"])
  assert e.value.file == str(index)


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


_POOL_AFTER_A_READ = """
import sys
import pyarrow as pa
from bagel_grain.sources import parquet
before = pa.default_memory_pool().backend_name
source = parquet.ParquetRowSource([sys.argv[1]], ["id"])
source[0]  # its row group held in the cache
pool = parquet._memory_pool()
print(before, pa.default_memory_pool().backend_name, pool.backend_name, pool.bytes_allocated())
"""


@pytest.mark.parametrize("chosen", [None, "system"])
def test_row_groups_are_read_into_jemalloc_without_changing_the_hosts_default_pool(
    tmp_path, chosen):
  # mimalloc, pyarrow's default, kept the row groups read-ahead threads freed; a library
  # does not switch its host's allocator: the pool is passed to each read. The user's
  # ARROW_DEFAULT_MEMORY_POOL still wins.
  path = tmp_path / "rows.parquet"
  pq.write_table(pa.table({"id": ["a", "b"]}), path)
  env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
  if chosen:
    env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
  done = subprocess.run([sys.executable, "-c", _POOL_AFTER_A_READ, str(path)], env=env,
                        capture_output=True, text=True, timeout=120, check=True)
  before, after, used, held = done.stdout.split()
  assert before == after == (chosen or before)
  if chosen:
    assert used == chosen
    return
  try:
    pa.jemalloc_memory_pool()
  except NotImplementedError:
    pytest.skip("this pyarrow has no jemalloc")
  assert used == "jemalloc" and int(held) > 0 and after != "jemalloc"


_RSS_AROUND_A_READ = """
import sys
from bagel_grain.sources import parquet

def rss():
  with open("/proc/self/status", encoding="ascii") as f:
    return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmRSS:"))

source = parquet.ParquetRowSource([sys.argv[1]], ["image"])
len(source)  # the footer read
before = rss()
source[0]  # the whole row group decoded, held in the cache
print(rss() - before, source._cache.held_bytes)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_row_group_read_leaves_resident_only_what_the_cache_holds(tmp_path):
  # A binary column pyarrow wrote dictionary-first: Arrow's decoder copies the dictionary
  # page whole beside the column it builds, then frees the copy. jemalloc kept those
  # pages (as much again as the row group) until they aged, adding to the process's
  # peak beside the next reads; they go back to the kernel after each read.
  path = tmp_path / "images.parquet"
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, 1 << 20, np.uint8).tobytes() for _ in range(32)]
  pq.write_table(pa.table({"image": images}), path, row_group_size=32, compression="none")
  assert pq.ParquetFile(path).metadata.row_group(0).column(0).has_dictionary_page
  try:
    pa.jemalloc_memory_pool()
  except NotImplementedError:
    pytest.skip("this pyarrow has no jemalloc")
  env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
  done = subprocess.run([sys.executable, "-c", _RSS_AROUND_A_READ, str(path)], env=env,
                        capture_output=True, text=True, timeout=120, check=True)
  grown, held = map(int, done.stdout.split())
  assert held >= 32 << 20
  assert grown - held < held // 4, (grown >> 20, held >> 20)  # was about 2x held


def test_a_file_changed_after_the_build_drops_its_rows_in_every_process(tmp_path):
  folder = tmp_path / "pq"
  folder.mkdir()
  path = write_parquet(folder / "a.parquet", [["a:0", "a:1"], ["a:2"]])
  source = dataset_source(str(folder), None, ["id"])
  worker = pickle.loads(pickle.dumps(source))  # what a worker gets: the build's listing
  before = os.stat(path)
  write_parquet(path, [["b:0", "b:1"], ["b:2"]])  # the same shape, other rows
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))  # a later write
  for process in (source, worker):
    with pytest.raises(Drop, match=r"a\.parquet changed since the stream was built") as e:
      process[0]
    assert e.value.reason == DropReason.UNREADABLE_FILE
