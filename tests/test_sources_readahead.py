"""Read-ahead: upcoming records and their files read concurrently, served once, bounded, closed."""

import collections
import concurrent.futures
import threading
import time

import grain
import pytest
from hypothesis import given, settings, strategies as st

from bagel_grain.drops import Drop, DropReason
from bagel_grain.families.files import DiskFiles
from bagel_grain.pipeline import build_pipeline
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources import readahead
from bagel_grain.sources.readahead import ReadAhead, ReadAheadRecords
from bagel_grain.sources.records import ConcatSource, ShuffledRecords
from parquet_files import ALL_IDS, NON_EMPTY_ROW_GROUPS, two_files

THREAD_PREFIX = "bagel-grain-readahead"


@pytest.fixture(autouse=True)
def reads_ahead_everything(monkeypatch):
  """This process reads ahead every element (as without workers), whatever ran before."""
  monkeypatch.setattr(readahead, "_SHARE", (0, 1))


class CountingRecords(grain.MapDataset):
  """Record i is the string `r<i>`; counts reads; `wait(i)` runs before a read returns."""

  def __init__(self, n, wait=lambda i: None):
    super().__init__()
    self.n, self.wait, self.reads = n, wait, collections.Counter()
    self.lock = threading.Lock()

  def __len__(self):
    return self.n

  def __getitem__(self, index):
    self.wait(index)
    with self.lock:
      self.reads[index] += 1
    return f"r{index}"


def _no_files(record):
  return []


def _read_ahead_threads():
  return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def _left_running(before, wait_s=30):
  """Read-ahead threads started since `before` still alive after `wait_s` (threads of an
  earlier test in this process are not this test's to count)."""
  until = time.monotonic() + wait_s
  while True:  # polled: a thread just starting cannot be joined yet
    running = [t for t in _read_ahead_threads() if t not in before and t.is_alive()]
    if not running or time.monotonic() > until:
      return running
    time.sleep(0.01)


def test_upcoming_records_are_read_concurrently_and_each_read_once():
  # Records 1-4 pass only when four reads are in flight at once: a consumer reading
  # them one by one would break the barrier.
  barrier = threading.Barrier(4, timeout=30)
  records = CountingRecords(12, wait=lambda i: barrier.wait() if 1 <= i <= 4 else None)
  before = _read_ahead_threads()
  ahead = ReadAhead(threads=4)
  ra = ReadAheadRecords(records, files_of=_no_files, read_file=None, ahead=ahead, depth=4)
  try:
    assert [ra[i] for i in range(12)] == [f"r{i}" for i in range(12)]
  finally:
    ahead.close()
  assert records.reads == {i: 1 for i in range(12)}  # the consumer took what was read ahead
  assert not _left_running(before)


def test_a_failed_read_ahead_is_read_again_by_the_consumer():
  failed = set()

  def fail_once(i):
    if i == 2 and i not in failed:
      failed.add(i)
      raise OSError("first read of 2 fails")

  records = CountingRecords(5, wait=fail_once)
  ahead = ReadAhead()
  ra = ReadAheadRecords(records, files_of=_no_files, read_file=None, ahead=ahead, depth=3)
  try:
    assert [ra[i] for i in range(5)] == [f"r{i}" for i in range(5)]
  finally:
    ahead.close()
  assert failed == {2} and records.reads[2] == 1  # counted on the consumer's own read


def test_files_a_record_names_are_read_ahead_for_the_file_store(tmp_path):
  (tmp_path / "r1.png").write_bytes(b"on disk")
  reads = []

  def read_file(path):
    reads.append(path)
    return b"read ahead"

  disk = DiskFiles(str(tmp_path))
  ahead = ReadAhead()
  ra = ReadAheadRecords(CountingRecords(3), files_of=lambda r: [disk.locate(f"{r}.png")],
                        read_file=read_file, ahead=ahead, depth=2)
  try:
    assert ra[0] == "r0" and ra[1] == "r1"  # record 1 was read ahead, and its file with it
    store = DiskFiles(str(tmp_path), ahead)
    path = store.locate("r1.png")
    assert store.read(path) == b"read ahead"
    assert store.read(path) == b"on disk"  # served once; then the disk as always
  finally:
    ahead.close()
  assert str(tmp_path / "r1.png") in reads


def test_what_was_read_ahead_for_indices_passed_over_is_let_go(tmp_path):
  # With workers, a process is asked for every few indices of a group; what it read
  # ahead for the others is never taken, and must not be held until the byte bound.
  for name in ("r1", "r2", "r5"):
    (tmp_path / f"{name}.png").write_bytes(b"x")
  disk = DiskFiles(str(tmp_path))
  ahead = ReadAhead(max_bytes=1 << 30)
  ra = ReadAheadRecords(CountingRecords(40), files_of=lambda r: [disk.locate(f"{r}.png")],
                        read_file=lambda path: b"read ahead", ahead=ahead, depth=5)
  try:
    assert ra[0] == "r0"
    for i in range(1, 6):  # wait until records 1-5 and their files are read ahead
      ahead._reads[("record", i)].result(timeout=30)
    held = lambda: set(ahead._reads)
    assert ("record", 3) in held() and ("file", disk.locate("r2.png")) in held()
    assert ra[5] == "r5"  # 1-4 were computed elsewhere
    assert not {("record", i) for i in range(1, 6)} & held()
    assert ("file", disk.locate("r2.png")) not in held()
    assert ("file", disk.locate("r5.png")) in held()  # the record asked keeps its file
    assert {key for key in held() if key[0] == "record"} == {("record", i) for i in range(6, 11)}
  finally:
    ahead.close()


def test_a_file_whose_read_ahead_failed_gives_the_usual_verdict(tmp_path):
  (tmp_path / "here.png").write_bytes(b"on disk")

  def broken():
    raise OSError("network down")

  ahead = ReadAhead()
  store = DiskFiles(str(tmp_path), ahead)
  here, gone = store.locate("here.png"), store.locate("gone.png")
  try:
    ahead.start(("file", here), broken)
    ahead.start(("file", gone), broken)
    assert store.read(here) == b"on disk"
    with pytest.raises(Drop) as e:
      store.read(gone)
    assert e.value.reason == DropReason.MISSING_FILE
  finally:
    ahead.close()


def test_a_read_that_does_not_fit_beside_those_held_is_not_started():
  ahead = ReadAhead(threads=2, max_bytes=100)
  try:
    for key in range(10):
      ahead.start(key, lambda k=key: (k, 40))
      concurrent.futures.wait(list(ahead._reads.values()), timeout=30)  # pylint: disable=protected-access
    # 40 bytes each: a read starts only if it fits beside those held, so two are.
    assert [k for k in range(10) if ahead.take(k) is not None] == [0, 1]
  finally:
    ahead.close()


def test_reads_in_flight_count_against_the_bound():
  release = threading.Event()
  ahead = ReadAhead(threads=8, max_bytes=100)
  try:
    admitted = [ahead.start(k, lambda: (release.wait(30), 40), size=40) for k in range(5)]
    assert admitted == [True, True, False, False, False]  # 3 x 40 would not fit in 100
    assert ahead.held_bytes() == 80
    release.set()
    assert ahead.take(0) is not None and ahead.start(2, lambda: (b"", 40), size=40)
  finally:
    release.set()
    ahead.close()


def test_one_read_larger_than_the_bound_is_admitted_alone():
  release = threading.Event()
  ahead = ReadAhead(threads=4, max_bytes=100)
  try:
    assert ahead.start("big", lambda: (release.wait(30), 500), size=500)
    assert not ahead.start("small", lambda: (b"", 10), size=10)  # not beside the big one
    release.set()
    assert ahead.take("big") is not None
    assert ahead.start("small", lambda: (b"", 10), size=10)
  finally:
    release.set()
    ahead.close()


def test_a_failed_read_ahead_is_forgotten_at_once():
  ahead = ReadAhead(threads=1, max_threads=1, max_bytes=100)  # one thread: reads in turn

  def broken():
    raise OSError("AWS Error NETWORK_CONNECTION")

  try:
    assert ahead.start("k", broken, size=60)
    ahead.start("later", lambda: (b"x", 1), size=1)  # one thread: runs after the failure
    assert ahead.take("later") == b"x"
    assert "k" not in ahead._reads and ahead.held_bytes() == 0  # pylint: disable=protected-access
    assert ahead.take("k") is None
  finally:
    ahead.close()


class SizedRecords(CountingRecords):
  """Records whose sizes are known unread (as JSONL lines' are); tracks the bytes read
  but not yet taken by the consumer, and their peak."""

  def __init__(self, sizes):
    super().__init__(len(sizes))
    self.sizes, self.outstanding, self.peak = sizes, 0, 0

  def record_bytes(self, index):
    return self.sizes[index]

  def __getitem__(self, index):
    record = super().__getitem__(index)
    with self.lock:
      self.outstanding += self.sizes[index]
      self.peak = max(self.peak, self.outstanding)
    return record

  def taken(self, index):
    with self.lock:
      self.outstanding -= self.sizes[index]


@pytest.mark.parametrize("sizes, bound", [
    ([1_000_000 if i % 3 == 0 else 100 for i in range(32)], 2_500_000),
    # junk lines each over the whole bound: each read ahead alone
    ([5_000_000 if i % 4 == 1 else 100 for i in range(16)], 1_000_000)])
def test_records_read_ahead_never_hold_more_than_the_bound(sizes, bound):
  # Bytes read and not yet consumed: at most the bound (or one record over it) read ahead,
  # plus the record the consumer reads itself. Reading ahead all 32 would hold 11 MB.
  most = max(bound, max(sizes)) + max(sizes)
  records = SizedRecords(sizes)
  ahead = ReadAhead(threads=8, max_bytes=bound)
  ra = ReadAheadRecords(records, files_of=_no_files, read_file=None, ahead=ahead, depth=32)
  try:
    for i in range(len(sizes)):
      assert ra[i] == f"r{i}"
      records.taken(i)
  finally:
    ahead.close()
  assert records.peak <= most
  assert records.reads == {i: 1 for i in range(len(sizes))}


def test_a_worker_reads_ahead_only_the_elements_it_decodes(monkeypatch):
  monkeypatch.setattr(readahead, "_SHARE", (1, 3))  # worker 1 of 3: elements 1, 4, 7, ...
  records = CountingRecords(40)
  ahead = ReadAhead(threads=4)
  ra = ReadAheadRecords(records, files_of=_no_files, read_file=None, ahead=ahead, depth=12)
  try:
    assert ra[1] == "r1" and ra[4] == "r4"
    for key in list(ahead._reads):  # pylint: disable=protected-access
      ahead._reads[key].result(timeout=30)  # pylint: disable=protected-access
  finally:
    ahead.close()
  read_ahead = set(records.reads) - {1, 4}
  assert read_ahead and all(readahead.owner(i, 3) == 1 for i in read_ahead)


def test_a_row_group_is_read_once_however_many_threads_want_its_rows(tmp_path):
  source = ParquetRowSource(list(two_files(tmp_path)), ["id"])
  records = ShuffledRecords(ConcatSource([source]), seed=3, num_epochs=1)
  ahead = ReadAhead(threads=8)
  ra = ReadAheadRecords(records, files_of=_no_files, read_file=None, ahead=ahead, depth=8)
  try:
    ids = [ra[i].fields["id"] for i in range(len(ra))]
  finally:
    ahead.close()
  assert source.row_group_reads == NON_EMPTY_ROW_GROUPS
  assert ids == [records[i].fields["id"] for i in range(len(records))]
  assert sorted(ids) == sorted(ALL_IDS)


def test_the_pipeline_stops_its_read_ahead_threads_when_closed(demo_config, demo_tokenizer):
  before = _read_ahead_threads()
  it = iter(build_pipeline(demo_config, demo_tokenizer, batch_size=2, workers=0))
  try:
    for _ in range(3):
      next(it)
    assert [t for t in _read_ahead_threads() if t not in before]
  finally:
    it.close()
  assert not _left_running(before)


def test_close_does_not_wait_forever_on_a_stalled_read(monkeypatch):
  monkeypatch.setattr(readahead, "CLOSE_WAIT_S", 0.1)
  started, release = threading.Event(), threading.Event()

  def stalled():
    started.set()
    release.wait(60)
    return b"late", 4

  before = _read_ahead_threads()
  ahead = ReadAhead(threads=1)
  ahead.start("stalled", stalled)
  assert started.wait(30)
  ahead.close()  # returns although the read is still in flight
  assert not release.is_set()
  release.set()
  assert not _left_running(before)


def test_a_file_two_records_name_is_read_once_and_served_to_each(tmp_path):
  # Two lines about the same image within the read-ahead window (or the same line in two
  # epochs of a small corpus): the second hint must not be lost when the first is served.
  (tmp_path / "shared.png").write_bytes(b"on disk")
  disk = DiskFiles(str(tmp_path))
  reads = collections.Counter()

  def read_file(path):
    reads[path] += 1
    return b"read ahead"

  ahead = ReadAhead(max_bytes=1 << 30)
  ra = ReadAheadRecords(CountingRecords(6), files_of=lambda r: [disk.locate("shared.png")],
                        read_file=read_file, ahead=ahead, depth=5)
  path = disk.locate("shared.png")
  try:
    assert ra[0] == "r0"
    # Records 1-5 are read ahead on threads; on a busy machine the loop below could take
    # every file before they started theirs. Wait until all six hold the one read.
    holders, until = ahead._holders, time.monotonic() + 30  # pylint: disable=protected-access
    while holders.get(("file", path)) != 6 and time.monotonic() < until:
      time.sleep(0.01)
    for i in range(6):
      assert i == 0 or ra[i] == f"r{i}"
      assert DiskFiles(str(tmp_path), ahead).read(path) == b"read ahead"
  finally:
    ahead.close()
  assert reads[path] <= 2  # once for record 0 (read by the consumer), once for 1-5 held


def test_a_file_the_consumer_did_not_take_is_let_go_once():
  ahead = ReadAhead()
  try:
    for _ in range(2):  # two takers of one read
      assert ahead.start("k", lambda: (b"v", 1))
    ahead.hand_over(["k"])
    ahead.hand_over([])  # the first taker's element ended without taking it
    assert ahead.take("k") == b"v"  # the second taker still gets it
    assert ahead.take("k") is None and ahead.held_bytes() == 0
  finally:
    ahead.close()


def test_a_frame_folder_is_listed_ahead_and_its_frames_read_together(tmp_path, monkeypatch):
  folder = tmp_path / "clip"
  folder.mkdir()
  for i in range(4):
    (folder / f"frame_{i}.jpg").write_bytes(b"frame %d" % i)
  disk = DiskFiles(str(tmp_path))
  located = disk.locate("clip/")
  ahead = ReadAhead(threads=4)
  ra = ReadAheadRecords(CountingRecords(3), files_of=lambda r: [located],
                        read_file=lambda p: b"never a file", ahead=ahead, depth=2)
  started = threading.Barrier(4, timeout=30)  # four frame reads in flight at once
  real_read = readahead.fs.read_file

  def frame_read(path, max_bytes):
    started.wait()
    return real_read(path, max_bytes)

  try:
    assert ra[0] == "r0" and ra[1] == "r1"
    ahead._reads[("list", located)].result(timeout=30)
    store = DiskFiles(str(tmp_path), ahead)
    monkeypatch.setattr("bagel_grain.families.files.fs.list_files", None)  # must come ahead
    frames = store.list_frames(located)
    assert [f.rsplit("/", 1)[1] for f in frames] == [f"frame_{i}.jpg" for i in range(4)]
    monkeypatch.setattr("bagel_grain.families.files.fs.read_file", frame_read)
    with store.reading(frames):
      assert [store.read(f) for f in frames] == [b"frame %d" % i for i in range(4)]
    with store.reading(frames):  # a drop after one frame: the rest is not held
      store.read(frames[0])
    assert not [k for k in ahead._reads if k[0] == "file"]
  finally:
    ahead.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "take", "forget"]),
                                     st.sampled_from("abc")), max_size=30))
def test_a_read_is_served_once_per_start_and_let_go_with_its_last_taker(ops):
  ahead = ReadAhead(max_bytes=1 << 30)
  holds = collections.Counter()  # the model: starts not yet taken or forgotten, per key
  try:
    for op, key in ops:
      if op == "start":
        assert ahead.start(key, lambda k=key: (k.encode(), 1))
        holds[key] += 1
      elif op == "take":
        assert ahead.take(key) == (key.encode() if holds[key] else None)
        holds[key] = max(0, holds[key] - 1)
      else:
        ahead.forget([key])
        holds[key] = max(0, holds[key] - 1)
      assert set(ahead._reads) == {k for k, n in holds.items() if n}
  finally:
    ahead.close()


def test_the_main_process_reads_ahead_the_elements_it_computes_while_workers_run(monkeypatch):
  monkeypatch.setattr(readahead, "_SHARE", None)  # workers run: nothing is this process's share
  barrier = threading.Barrier(4, timeout=30)  # reads 1-4 pass only when all four are in flight
  records = CountingRecords(12, wait=lambda i: barrier.wait() if 1 <= i <= 4 else None)
  ahead = ReadAhead(threads=4)
  ra = ReadAheadRecords(records, files_of=_no_files, read_file=None, ahead=ahead, depth=4)
  group = ra.map(lambda r: r.upper())
  try:
    assert group[0] == "R0"
    readahead.read_ahead_of(group, [1, 2, 3, 4])  # the fetcher's inline thread: its next ones
    readahead.read_ahead_of(group, [2, 3])  # asked again: each is read once
    assert [group[i] for i in (1, 2, 4)] == ["R1", "R2", "R4"]  # 3 went to a worker
    assert ahead.held_bytes() == 0  # what was passed over is let go
  finally:
    ahead.close()
  assert records.reads == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}
