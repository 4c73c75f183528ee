"""Reads of upcoming records and of the files they name, issued ahead on a few threads.

At object-store latency (tens of milliseconds a request) a process that reads one
record, then its image, then decodes, spends most of its time waiting. A group's
records are read in index order, so `ReadAheadRecords`, asked for element i,
starts the reads of elements i+1 .. i+depth on a small thread pool: the record
(a JSONL line, a parquet row group through the source's cache), then the files
the family says the record will open (`FamilyTransform.files_ahead`). The
consumer takes what was read ahead; nothing is decoded ahead, so the stream is
the same bytes in the same order.

`ReadAhead` holds what was read, bounded in bytes: a read is admitted only when
its size (known before reading: a JSONL line's length from its offsets, a local
file's from one stat; else the mean of the reads done so far) fits in the bound
beside the reads held and in flight; one read larger than the whole bound is
admitted alone. Nothing is pushed out to make room: what will not be taken is
forgotten by its reader (`ReadAheadRecords`). A read that failed, or is not
done after `WAIT_S`, is not served and not kept: the consumer reads for itself,
under the storage retry policy (`bagel_grain.storage`), and meets the usual
drop or error. Reads ahead try once (a transient failure is the consumer's to
wait out) and end by the group's storage deadline (`storage_timeout_s` from
their start, inside the request too); the consumer waits for one no longer than
its own element's deadline. Its threads (daemon threads, started on first use)
stop at `close()` (the fetcher closes them with the iterator): close does not
wait for a read in flight, and neither does the interpreter's exit (a pool of
`concurrent.futures` would join them there).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from typing import Any, Callable, Hashable, Iterable

import grain

from bagel_grain import fs, held_memory, interpreter_exit, ranged_file
from bagel_grain.storage import RetryPolicy, element_deadline, single_attempts

THREADS = 8  # requests in flight per group and process, at least
MAX_THREADS = 64  # ... and at most, as latency asks (see `ReadAhead.target_in_flight`)
DEPTH = 256  # elements read ahead of the one asked for, at most
MIN_DEPTH = 32  # ... and at least; between, four times the reads wanted in flight
MAX_BYTES = 64 << 20  # read but not yet taken, per group and process
WAIT_S = 60.0  # a read ahead not done by then (or the element's deadline) is done again
CLOSE_WAIT_S = 0.5  # close waits this long for idle threads to end, never for a read
MAX_LIST_AHEAD = 1 << 16  # a frame folder listed ahead: more entries is a verdict served as such
_FIRST_GUESS = 256 << 10  # size assumed for a read of unknown size before any is done
_SMOOTHING = 0.1  # weight of the newest sample in the latency and rate averages

# The elements this process decodes, so reads ahead: (worker, workers), or None for
# none (the main process while workers run). See `owner`.
_SHARE: tuple[int, int] | None = (0, 1)


def owner(index: int, workers: int) -> int:
  """The worker that decodes a group's element `index` (the fetcher hands it out so)."""
  return index % workers


def set_share(share: tuple[int, int] | None) -> None:
  """Which elements this process reads ahead: those `owner` gives worker `share[0]` of
  `share[1]`; None: none (they are read ahead by the workers that decode them)."""
  global _SHARE  # pylint: disable=global-statement
  _SHARE = share


def _mine(index: int) -> bool:
  share = _SHARE
  return share is not None and owner(index, share[1]) == share[0]


class ReadAhead:
  """Values read in the background by key: `start` a read, `take` its value (or None).

  `storage` is the retry policy of the group's consumer (the file store reads
  under it); the reads here try once.

  How many reads may be in flight adapts to what it sees (Little's law): the mean
  time a read takes times the rate at which values are taken, doubled, between
  `threads` and `max_threads`. At local-disk speed that is the minimum; at 150 ms
  a request it grows until the consumer no longer waits.
  """

  def __init__(self, *, threads: int = THREADS, max_bytes: int = MAX_BYTES,
               storage: RetryPolicy | None = None, max_threads: int = MAX_THREADS):
    self._threads, self._max_bytes = threads, max_bytes
    self._max_threads = max(threads, max_threads)
    self.storage = storage or RetryPolicy()
    self._reset()

  def _reset(self) -> None:
    self._pool: DaemonThreads | None = None
    self._reads: collections.OrderedDict[Hashable, concurrent.futures.Future] = (
        collections.OrderedDict())
    self._admitted: dict[Hashable, int] = {}  # bytes counted for each read held
    self._known: set[Hashable] = set()  # reads whose size was known before reading
    self._holders: dict[Hashable, int] = {}  # reads started for several takers (see `start`)
    self._handed: set[Hashable] = set()  # the consumer's to take now (see `hand_over`)
    self._done_bytes, self._done_reads = 0, 0  # for the size of reads of unknown size
    self._read_s = 0.0  # mean time a read takes
    self._take_gap_s: float | None = None  # mean time between two takes
    self._last_take: float | None = None
    self._lock = threading.Lock()
    held_memory.register(self, held_memory.READ_AHEAD, ReadAhead.held_bytes)

  def __getstate__(self):  # no threads, no reads
    return {"_threads": self._threads, "_max_bytes": self._max_bytes, "storage": self.storage,
            "_max_threads": self._max_threads}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset()

  def held_bytes(self) -> int:
    """Bytes counted against the bound: reads held, finished or in flight."""
    with self._lock:
      return self._counted()

  def _counted(self) -> int:
    counted = 0
    for key, future in self._reads.items():
      if future.done() and not future.cancelled() and future.exception() is None:
        counted += self._admitted[key] if key in self._known else future.result()[1]
      elif not future.done():
        counted += self._admitted[key]  # a failed read holds nothing
    return counted

  def target_in_flight(self) -> int:
    """Reads to keep in flight: what the consumer takes while one read is done, doubled."""
    if not self._take_gap_s:
      return self._threads
    wanted = 2 * self._read_s / self._take_gap_s
    return int(min(self._max_threads, max(self._threads, wanted)))

  def _in_flight(self) -> int:
    return sum(1 for f in self._reads.values() if not f.done())

  def _guess(self) -> int:
    return self._done_bytes // self._done_reads if self._done_reads else _FIRST_GUESS

  def start(self, key: Hashable, read: Callable[[], tuple[Any, int]],
            size: int | None = None, *, paced: bool = False) -> bool:
    """Reads `read()` -> (value, its size in bytes) in the background, unless `size` (None:
    unknown, guessed) does not fit beside what is held and in flight, or (`paced`) the reads
    in flight are already `target_in_flight()`. True when the read is held now: then one
    `take` or `forget` of `key` is due (a key started twice is read once and held until both
    are done)."""
    with self._lock:
      if key in self._reads:  # one read, served to each taker (an image two lines name)
        self._holders[key] = self._holders.get(key, 1) + 1
        return True
      need = self._guess() if size is None else size
      if self._reads and self._counted() + need > self._max_bytes:
        return False  # no room until some is taken (or forgotten)
      if paced and self._in_flight() >= self.target_in_flight():
        return False
      if self._pool is None:
        self._pool = DaemonThreads(self._max_threads, "bagel-grain-readahead")
      self._admitted[key] = need
      if size is not None:
        self._known.add(key)
      future = self._pool.submit(lambda: self._timed(read))
      self._reads[key] = future
    future.add_done_callback(lambda f: self._finished(key, f))
    return True

  def _timed(self, read: Callable[[], tuple[Any, int]]) -> tuple[Any, int]:
    start = time.monotonic()
    with fs.deadline_scope(start + self.storage.timeout_s):
      value = read()
    took = time.monotonic() - start
    with self._lock:
      self._read_s += _SMOOTHING * (took - self._read_s) if self._read_s else took
    return value

  def _finished(self, key: Hashable, future: concurrent.futures.Future) -> None:
    """Counts a read's size, or forgets a failed read at once (never served, never kept)."""
    if future.cancelled():
      return
    with self._lock:
      if future.exception() is None:
        self._done_bytes += future.result()[1]
        self._done_reads += 1
      elif self._reads.get(key) is future:
        self._drop(key)

  def _drop(self, key: Hashable) -> concurrent.futures.Future | None:
    """Forgets one read, for every taker (caller holds the lock)."""
    self._admitted.pop(key, None)
    self._known.discard(key)
    self._holders.pop(key, None)
    return self._reads.pop(key, None)

  def _release(self, key: Hashable) -> concurrent.futures.Future | None:
    """One taker lets go of a read, forgotten with its last one (caller holds the lock)."""
    held = self._holders.get(key, 1) - 1
    if held > 0 and key in self._reads:
      self._holders[key] = held
      return self._reads[key]
    return self._drop(key)

  def forget(self, keys: Iterable[Hashable]) -> None:
    """Drops reads that will not be taken (cancelled if not started yet)."""
    with self._lock:
      for key in keys:
        future = self._release(key)
        if future is not None and key not in self._reads:
          future.cancel()

  def hand_over(self, keys: Iterable[Hashable]) -> None:
    """Gives the consumer the reads held for the element it computes now; those of the
    element before that it did not take are forgotten."""
    with self._lock:
      left, self._handed = self._handed, set(keys)
    self.forget(left)

  def take(self, key: Hashable) -> Any | None:
    """The value read ahead for `key` (this taker's hold let go), or None: not started,
    failed, late. A failure is never served nor kept: the caller reads again."""
    with self._lock:
      if key in self._handed:
        self._handed.discard(key)
      future = self._release(key)
      now = time.monotonic()
      if self._last_take is not None:
        gap = now - self._last_take
        self._take_gap_s = (gap if self._take_gap_s is None
                            else self._take_gap_s + _SMOOTHING * (gap - self._take_gap_s))
      self._last_take = now
    if future is None:
      return None
    wait = min(WAIT_S, element_deadline(self.storage) - time.monotonic())
    try:
      return future.result(timeout=max(0.0, wait))[0]
    except Exception:  # pylint: disable=broad-except  # the consumer reads again, and sees it
      return None

  def close(self) -> None:
    """Drops what was read and stops the threads: idle ones end at once; a read in flight
    is left to end by its deadline on its own (close waits `CLOSE_WAIT_S` at most)."""
    with self._lock:
      pool, self._pool = self._pool, None
      for future in self._reads.values():
        future.cancel()
      self._reads.clear()
      self._admitted.clear()
      self._known.clear()
      self._holders.clear()
      self._handed.clear()
    if pool is not None:
      deadline = time.monotonic() + CLOSE_WAIT_S
      for thread in pool.shutdown():
        thread.join(max(0.0, deadline - time.monotonic()))


class DaemonThreads:
  """Up to `size` daemon threads running submitted calls (reads, which try once).

  Not `concurrent.futures.ThreadPoolExecutor`: its threads are joined at the
  interpreter's exit, so one read stuck on a silent server kept the process alive.
  """

  def __init__(self, size: int, name: str):
    self._size, self._name = size, name
    self._cond = threading.Condition()
    self._queue: collections.deque[tuple[concurrent.futures.Future, Callable]] = (
        collections.deque())
    self._threads: list[threading.Thread] = []
    self._idle = 0
    self._stopped = False

  def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._cond:
      self._queue.append((future, call))
      if len(self._queue) > self._idle and len(self._threads) < self._size:
        thread = threading.Thread(target=self._run, daemon=True,
                                  name=f"{self._name}_{len(self._threads)}")
        self._threads.append(thread)
        thread.start()
      self._cond.notify()
    return future

  def _run(self) -> None:
    single_attempts()
    while True:
      with self._cond:
        self._idle += 1
        while not self._queue and not self._stopped:
          self._cond.wait()
        self._idle -= 1
        if self._stopped:
          return
        future, call = self._queue.popleft()
      if not future.set_running_or_notify_cancel():
        continue
      try:
        with interpreter_exit.working():  # a read may be inside pyarrow's C++
          result = call()
      except BaseException as e:  # pylint: disable=broad-except  # the taker sees it
        future.set_exception(e)
      else:
        future.set_result(result)

  def shutdown(self) -> list[threading.Thread]:
    """Cancels what has not started and stops the threads (each after its current call);
    returns them, to wait for a while if the caller wants."""
    with self._cond:
      self._stopped = True
      for future, _ in self._queue:
        future.cancel()
      self._queue.clear()
      self._cond.notify_all()
      return list(self._threads)


class ReadAheadRecords(grain.MapDataset):
  """A group's records, element i served from reads started when an earlier one was asked.

  `files_of(record)` names the files the family will read for a record; they are
  read ahead into `ahead` under ("file", path), where the family's file store
  takes them. Hints go forward from the highest index asked so far, so each
  element is read ahead at most once per process. A process is asked for a group's
  elements in increasing order, so what was read ahead for an index below the one
  asked is never taken (another worker computed it): it is forgotten, with its
  files, rather than held until the byte bound pushes it out.
  """

  def __init__(self, records: grain.MapDataset, *, files_of: Callable[[Any], Iterable[str]],
               read_file: Callable[[str], bytes], ahead: ReadAhead, depth: int = DEPTH):
    super().__init__(records)
    self._records, self._files_of, self._read_file = records, files_of, read_file
    self.ahead, self._depth = ahead, depth
    self._hinted = -1  # the highest index whose read was started (or done by the consumer)
    self._asked = -1  # the last index asked for: (asked, hinted] are read ahead, not taken
    self._files: dict[int, list[str]] = {}  # the files read ahead for those indices
    self._requested: set[int] = set()  # read ahead past `_hinted` by `read_ahead`

  def __getstate__(self):
    state = self.__dict__.copy()
    state.update(_hinted=-1, _asked=-1, _files={}, _requested=set())
    return state

  def __len__(self) -> int:
    return len(self._records)

  def __str__(self) -> str:
    return f"ReadAheadRecords(depth={self._depth})"

  def _read(self, index: int) -> tuple[Any, int]:
    record = self._records[index]
    if index < self._asked:  # passed while it was read: nobody here will take its files
      return record, 0
    self._start_files(index, record)
    return record, _size(getattr(record, "fields", None))

  def _start_files(self, index: int, record: Any) -> None:
    """Starts the reads of the files `record` names, all at once: a file's bytes, or a frame
    folder's listing (which frames are read is drawn when the record is parsed)."""
    started = []
    for path in self._files_of(record):
      if isinstance(path, ranged_file.VideoHead):  # a video object's size and first bytes,
        held = self.ahead.start(("video", path.path),  # counted at their most
                                lambda p=path.path: ranged_file.read_head(p),
                                size=ranged_file.WHOLE_BYTES)
      elif path.endswith(("/", os.sep)):
        held = self.ahead.start(("list", path), lambda p=path: _listed(p))
      else:
        held = self.ahead.start(("file", path), lambda p=path: _sized(self._read_file(p)),
                                size=_local_size(path))
      if held:  # each one taken or forgotten once
        started.append(path)
    self._files[index] = started

  def _record_size(self, index: int) -> int | None:
    """The record's size when the source knows it before reading (a JSONL line's length)."""
    size_of = getattr(self._records, "record_bytes", None)
    return None if size_of is None else size_of(index)

  def read_ahead(self, indices: Iterable[int]) -> None:
    """Starts the reads of elements this process will compute although they are not its
    share (`_mine`): the main process's own, while workers run (the first elements, and
    any no worker has taken). Each index once; paced and bounded as the hints are."""
    for index in indices:
      if (index <= self._asked or index in self._requested
          or index <= self._hinted and _mine(index)):  # started already
        continue
      if not self.ahead.start(("record", index), lambda i=index: self._read(i),
                              size=self._record_size(index), paced=True):
        break
      self._requested.add(index)

  def _forget_below(self, index: int) -> None:
    hinted = range(self._asked + 1, min(index, self._hinted + 1))
    passed_requests = {i for i in self._requested if i < index}
    self._requested -= passed_requests | {index}
    stale = [("record", i) for i in sorted(set(hinted) | passed_requests)]
    self._asked = index
    for passed in [i for i in list(self._files) if i < index]:  # read-ahead threads add keys
      stale.extend(_file_keys(self._files.pop(passed, ())))
    self.ahead.forget(stale)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    self._forget_below(index)
    record = self.ahead.take(("record", index))
    if record is None:  # read here first: the sources load their arrays on the first read
      record = self._records[index]
      self._start_files(index, record)  # its files together, not one after the other
    self.ahead.hand_over(_file_keys(self._files.pop(index, [])))  # the consumer takes them next
    self._hinted = max(self._hinted, index)
    depth = min(self._depth, max(MIN_DEPTH, 4 * self.ahead.target_in_flight()))
    for ahead in range(self._hinted + 1, min(index + depth + 1, len(self))):
      if _mine(ahead) and not self.ahead.start(
          ("record", ahead), lambda i=ahead: self._read(i), size=self._record_size(ahead),
          paced=True):
        break  # the bound is full, or enough in flight: the next call goes on from here
      self._hinted = ahead
    return record


def _records_under(datasets: Iterable[Any]) -> list[ReadAheadRecords]:
  """The `ReadAheadRecords` under any of `datasets` (MapDatasets and their parents)."""
  seen, todo, found = set(), list(datasets), []
  while todo:
    dataset = todo.pop()
    if id(dataset) in seen or not isinstance(dataset, grain.MapDataset):
      continue
    seen.add(id(dataset))
    if isinstance(dataset, ReadAheadRecords):
      found.append(dataset)
    todo.extend(dataset.parents)
  return found


def close_read_ahead(datasets: Iterable[Any]) -> None:
  """Stops the read-ahead threads under any of `datasets` (MapDatasets and their parents)."""
  for records in _records_under(datasets):
    records.ahead.close()


def read_ahead_of(dataset: Any, indices: Iterable[int]) -> None:
  """Starts this process's reads of a group's elements `indices` (`dataset`: the group's
  MapDataset, whose element i is its records' element i), whoever `owner` says decodes
  them: the fetcher's inline thread computes them itself."""
  indices = list(indices)
  for records in _records_under([dataset]):
    records.read_ahead(indices)


def _local_size(path: str) -> int | None:
  """A local file's size (one stat); None for an object (a HEAD would cost a request)."""
  if "://" in path:
    return None
  try:
    return os.stat(path).st_size
  except OSError:
    return None  # the consumer's read gives the verdict


def _sized(data: bytes) -> tuple[bytes, int]:
  return data, len(data)


def _listed(folder: str) -> tuple[list[str] | fs.ListingTooLong, int]:
  """A frame folder's files, listed to `MAX_LIST_AHEAD`; a folder of more is served as the
  `ListingTooLong` itself: a definite verdict, which the consumer takes rather than listing
  the same pages again (`DiskFiles.list_frames`)."""
  try:
    paths = fs.list_files(folder, max_entries=MAX_LIST_AHEAD)
  except fs.ListingTooLong as e:
    e.__traceback__ = None  # held until taken: not the frames of the listing
    return e, 0
  return paths, sum(len(p) for p in paths)


def _file_keys(paths: Iterable[str | ranged_file.VideoHead]) -> list[tuple[str, str]]:
  """The read-ahead keys of a record's files: ("list", folder), ("video", object) (its
  head, see `ranged_file.VideoHead`) or ("file", path)."""
  return [("video", p.path) if isinstance(p, ranged_file.VideoHead)
          else ("list" if p.endswith(("/", os.sep)) else "file", p) for p in paths]


def _size(value: Any) -> int:
  """Roughly the bytes a record's fields hold (what the byte bound counts)."""
  if isinstance(value, (bytes, bytearray, str)):
    return len(value)
  if isinstance(value, dict):
    return sum(_size(v) for v in value.values())
  if isinstance(value, (list, tuple)):
    return sum(_size(v) for v in value)
  return 8
