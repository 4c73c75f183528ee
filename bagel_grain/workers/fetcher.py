"""Elements of the groups' MapDatasets by index, computed ahead by worker processes.

Each group is consumed in index order, so the fetcher keeps a window of the next
indices of every group in flight. Results are addressed by (group, index), never
by arrival order: the packed stream is the same for any number of workers. When
the element the packer needs has not been handed to a worker yet (workers still
starting, or all busy), the main process computes it itself instead of waiting:
the first batch does not wait for worker start-up.

The main thread never waits without a deadline. Elements the main process computes
run on one helper thread (the inline thread), so a read that stalls, or a worker
that stops answering, becomes an error after `element_timeout_s` naming the group,
index and record; a Ctrl-C while waiting leaves the element to finish in the
background, ready for the next call. Without workers the inline thread also
computes the next element of the group just asked for (`INLINE_AHEAD`), so the
packer's own work on a row overlaps a decode instead of alternating with it.

A thread of the main process (the pump) hands jobs to the workers and drains their
results as soon as they are sent, so a worker never waits on a busy packer. A result's
arrays arrive as views of the worker's shared-memory slab (`workers/slab.py`), so the
pump moves metadata, not pixels; it gives each worker back the regions of its slab
that nothing references any more. Each
worker has a socket of its own (not a shared result queue): a worker that dies,
even halfway through sending a result, closes the only writer of its socket, so
the pump sees end-of-file or the process sentinel and the packer gets a
WorkerError instead of hanging. After that the fetcher stays failed.

Storage that keeps failing past its deadline is not a failure of the fetcher: a
worker (or the inline thread) reports a `StorageUnavailableError` as the outcome
of that one element, the packer's call raises it, and the element is forgotten,
so the next call for it computes it again (`bagel_grain.storage`). What storage
cost (retries, seconds waited) is summed per group into `storage.COUNTS`.

Starting and talking to a worker process: `workers/process.py`.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.process
import multiprocessing.reduction
import os
import pickle
import select
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from bagel_grain import c_heap, interpreter_exit, storage
from bagel_grain.config import PipelineConfig
from bagel_grain.errors import StorageUnavailableError
from bagel_grain.sources import readahead
from bagel_grain.sources.readahead import close_read_ahead
from bagel_grain.workers import arena as arenas
from bagel_grain.workers import slab as slabs
from bagel_grain.workers.process import GUARD_HINT, Worker, WorkerError, recv, start_workers

_MIN_START_TIMEOUT_S = 120.0  # importing the main script on a busy host can take that long
JOBS_PER_WORKER = 4  # handed out ahead, so a worker never idles between results
INLINE_AHEAD = 1  # without workers: next elements of a group computed while the packer packs
INLINE_READ_AHEAD = 8  # untaken elements per group whose reads the inline thread starts
_POLL_S = 1.0
_DRAINING = object()  # `_awaited` while reset() waits for every element handed out


class _Failure:
  """An exception an element's computation raised (inline, or a worker's retriable storage
  error), re-raised by the caller; the element is then computed again if asked again."""

  def __init__(self, error: BaseException):
    self.error = error
    self.at = time.monotonic()

  def stale(self, since: float) -> bool:
    """A storage failure that came in before `since` (while nobody waited for it): storage
    may be back, so it is computed again rather than raised."""
    return isinstance(self.error, StorageUnavailableError) and self.at < since


class Fetcher:
  """`get(group, index)`: the element, from `workers` processes or the inline thread (0).

  `describe(group, index)` names an element in errors (group, index and record);
  `timeout_s` bounds one element's computation, and one worker's start-up (at least
  two minutes). `names` (default `group N`) are the groups' names in storage's counters.
  """

  def __init__(self, datasets: Sequence[Any], *, workers: int, depths: Sequence[int],
               timeout_s: float = PipelineConfig.element_timeout_s,
               describe: Callable[[int, int], str] | None = None,
               names: Sequence[str] | None = None):
    self._datasets = list(datasets)
    self._lengths = [len(d) for d in self._datasets]  # a length is a chain of calls: asked once
    self._names = list(names) if names is not None else [
        f"group {g}" for g in range(len(self._datasets))]
    self._depths = list(depths)
    self._timeout_s = float(timeout_s)
    self._describe = describe or (lambda group, index: f"group {group} element {index}")
    self._pid = os.getpid()
    self._pending: dict[tuple[int, int], None] = {}  # wanted, not yet handed out (ordered)
    # Per group, the last index asked for and the last one wanted ahead of it: asking for
    # the next index only wants what lies beyond (see get).
    self._asked = [(-1, -1)] * len(self._datasets)
    self._done: dict[tuple[int, int], Any] = {}
    self._workers: list[Worker] = []
    self._failure: str | None = None
    self._closed = False
    self._abandoned = threading.Event()  # set at close: the inline thread's reads stop retrying
    # One lock, two conditions: the caller waits for results (`_cond`, notified only for
    # the element it waits for: `_awaited`), the inline thread for work (`_queued`).
    lock = threading.RLock()
    self._cond, self._queued = threading.Condition(lock), threading.Condition(lock)
    self._awaited: tuple[int, int] | object | None = None
    self._inline_queue: collections.deque[tuple[int, int]] = collections.deque()
    self._inline_key: tuple[int, int] | None = None
    self._inline_since = 0.0
    self._read_ahead_started = False  # see _untaken
    self._wake_pending = False  # a byte is on its way to the pump (see _wake_once)
    # Elements computed in this process, and the CPU seconds they took (for reports); with
    # workers, how many were computed since the C heap's freed pages were last given back,
    # and how often they were (see `_run_inline`).
    self.inline_elements, self.inline_cpu_s = 0, 0.0
    self._next_trim, self.heap_trims, self.heap_trim_s = 0.0, 0, 0.0
    self._pump: threading.Thread | None = None
    self._copy_token = 0  # the last batch's copies sent (copy_and_wait)
    if workers > 0:
      try:
        payload = pickle.dumps(self._datasets, protocol=pickle.HIGHEST_PROTOCOL)
      except Exception as e:  # pylint: disable=broad-except  # any pickling failure
        raise WorkerError(
            f"the pipeline's datasets cannot be sent to worker processes ({type(e).__name__}: "
            f"{e}); every dataset, transform and tokenizer must be picklable. Use workers=0 "
            "to decode in this process.") from e
      self._workers = start_workers(multiprocessing.get_context("spawn"), workers)
      readahead.set_share(None)  # this process decodes only stragglers: no read-ahead
      c_heap.keep_thread_tops_trimmed()  # what its threads free there does go back (c_heap)
      self._payload = payload
      self._wake_reader, self._wake = os.pipe()  # a byte in it: look at `_pending` again
      self._pump = threading.Thread(target=self._run_pump, name="bagel-grain-fetch",
                                    daemon=True)
      self._pump.start()
    self._inline = threading.Thread(target=self._run_inline, name="bagel-grain-inline",
                                    daemon=True)
    self._inline.start()
    _LIVE.add(self)

  @property
  def workers(self) -> int:
    """How many worker processes it runs (0: everything in this process)."""
    return len(self._workers)

  def worker_memory(self) -> list[dict[str, Any]]:
    """Per worker, its "pid" and what it held (`held_memory.snapshot()`) after its imports
    ("at_hello"), once its datasets were loaded ("at_ready"), after its last element ("now")."""
    return [{"pid": w.process.pid, **w.memory} for w in self._workers]

  # -- the packer's side -------------------------------------------------------

  def get(self, group: int, index: int) -> Any:
    """The element, once computed; with workers, the group's next `depths[group]` are
    wanted too. Asked in index order, a call wants only the elements the previous call
    did not (those were wanted then, and only the caller's own calls take them); asked
    for an earlier index (a step put back), all of them again."""
    self._check_owner()
    if self._pump is not None and time.monotonic() >= self._next_trim:
      self._give_back_freed_heap()
    with self._cond:
      if self._pump is not None:
        wanted = self._want(group, index)
        last, upto = self._asked[group]
        ahead_to = index + self._depths[group]
        for ahead in range(max(index, upto) + 1 if index > last else index + 1, ahead_to + 1):
          wanted = self._want(group, ahead) or wanted
        self._asked[group] = (index, ahead_to)
        wake = wanted and self._wake_once()
      else:  # the one asked for first, then the next ones
        for ahead in range(INLINE_AHEAD + 1):
          self._queue_inline(group, index + ahead, first=ahead == 0)
        wake = False
    if wake:
      os.write(self._wake, b"w")
    return self._take((group, index))

  def get_many(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
    """Several elements at once (a restore's buffer), computed in parallel."""
    self._check_owner()
    keys = [(int(g), int(i)) for g, i in keys]
    with self._cond:
      wanted = [self._want(*key) for key in keys]
      wake = self._pump is not None and any(wanted) and self._wake_once()
    if wake:
      os.write(self._wake, b"w")
    return [self._take(key) for key in keys]

  def put_back(self, group: int, index: int, element: Any) -> None:
    """An element taken before (by `get`) and not used: the next `get` of it returns it
    rather than computing it again. Nothing is put back where it is being computed."""
    key = (group, index)
    with self._cond:
      if key not in self._done and not self._assigned(key):
        self._pending.pop(key, None)
        self._done[key] = element

  def _wake_once(self) -> bool:
    """Whether the caller should wake the pump: not if a wake it has not seen yet is under
    way (a syscall per element was a tenth of the main thread's time). The pump clears
    the flag, under the lock, just before it dispatches (caller holds the lock)."""
    wake, self._wake_pending = not self._wake_pending, True
    return wake

  def _want(self, group: int, index: int) -> bool:
    """Adds the element to those pending; True when a worker could take it now (the pump
    has to be woken: else the next result from its worker wakes it)."""
    key = (group, index)
    if (index >= self._lengths[group] or key in self._done or key in self._pending
        or self._assigned(key)):
      return False
    self._pending[key] = None
    w = self._workers[readahead.owner(index, len(self._workers))] if self._workers else None
    return w is not None and w.stage == "ready" and len(w.jobs) < JOBS_PER_WORKER

  def _queue_inline(self, group: int, index: int, *, first: bool = False) -> None:
    """Queues an element for the inline thread, after those queued, or (`first`) before
    them: wanted now (caller holds the lock)."""
    key = (group, index)
    if first and key in self._inline_queue:
      self._inline_queue.remove(key)
    if key in self._done or self._assigned(key) or (
        not first and index >= self._lengths[group]):
      return
    if first:
      self._inline_queue.appendleft(key)
    else:
      self._inline_queue.append(key)
    self._queued.notify()

  def _assigned(self, key: tuple[int, int]) -> bool:
    """Handed to a worker or to the inline thread (caller holds the lock)."""
    return (key == self._inline_key or key in self._inline_queue
            or any(key in w.jobs for w in self._workers))

  def _take(self, key: tuple[int, int]) -> Any:
    """Waits for the element. The pump wakes only the thread that waits for the element it
    received (`_awaited`): a second thread waiting at the same time would see its element
    at the next poll; the packer's calls are one thread's at a time."""
    began = time.monotonic()
    with self._cond:
      try:
        while True:
          self._check_inline_deadline()
          self._check()
          if key in self._done:
            value = self._done.pop(key)
            if isinstance(value, _Failure):
              if value.stale(began):
                continue  # not assigned any more: computed again below
              error = value.error
              del value  # raised from a frame that holds it, the error would hold that frame
              try:  # (a cycle): the failed step's batch buffer and samples lived on until a
                raise error  # full collection, each retry's (issue 27's soak)
              finally:
                del error
            return value
          if not self._assigned(key):
            self._pending.pop(key, None)  # no worker has it: do it here rather than wait
            self._queue_inline(*key, first=True)
          self._awaited = key
          self._cond.wait(_POLL_S)
      finally:
        self._awaited = None

  def _check(self) -> None:
    if self._failure is not None:
      raise WorkerError(self._failure)
    if self._closed:
      raise WorkerError("the fetcher was closed")

  def _check_owner(self) -> None:
    if os.getpid() != self._pid:
      raise WorkerError(
          f"this iterator belongs to process {self._pid}, and this process ({os.getpid()}) "
          "is a fork of it: its threads and worker processes stayed with the parent. Build "
          "a new iterator here (set_state with the parent's state continues its stream).")

  def _check_inline_deadline(self) -> None:
    """Fails when the inline thread's element overran (caller holds the lock)."""
    if (self._inline_key is not None
        and time.monotonic() - self._inline_since > self._timeout_s):
      self._fail(self._stalled(self._inline_key, "this process"))

  def _stalled(self, key: tuple[int, int], where: str) -> str:
    return (f"{self._describe(*key)} took longer than element_timeout_s = "
            f"{self._timeout_s:g} s in {where}: a read that stalls (a stuck network mount, an "
            "object store that stopped answering) or a decode that never ends. Fix the storage, "
            "or raise `element_timeout_s` if elements this slow are expected.")

  # -- the batch's copies (workers/arena.py) ------------------------------------

  def make_arena(self, specs: dict, slots: int) -> arenas.Arena | None:
    """A shared arena for batch buffers' pixel arrays, which these workers copy into
    (`packing.buffers.BatchBuffers.share`), or None where the system has none."""
    return arenas.Arena.create(specs, slots)

  def batch_copies(self, arena: arenas.Arena, slot: int) -> arenas.Copies:
    """The copies of one batch's pixels into `slot` of `arena`, done by these workers."""
    return arenas.Copies(arena, slot, self)

  def slab_of(self, array: Any) -> tuple[int, tuple] | None:
    """(the worker, where in its slab) for an array that lies in a worker's slab, else None."""
    address = slabs.address_of(array)
    for n, w in enumerate(self._workers):
      at = w.slab.where(array, address) if w.slab is not None else None
      if at is not None:
        return n, at
    return None

  def copy_and_wait(self, arena: Any, copies: dict[int, list]) -> None:
    """Sends each worker its copies into `arena` (and the arena, the first time), then waits
    until every one is acknowledged: a WorkerError if the fetcher fails meanwhile (a worker
    that dies, fails a copy, or takes longer than element_timeout_s)."""
    self._check_owner()
    with self._cond:
      self._check()
      self._copy_token += 1
      token = self._copy_token
      unwatched = [w for w in self._workers if not (w.jobs or w.copies or w.stage != "ready")]
      for n, items in copies.items():
        w = self._workers[n]
        try:
          if w.arena != arena.ident:
            w.conn.send(("arena", arena.size))
            multiprocessing.reduction.send_handle(w.conn, arena.fd, w.process.pid)
            w.arena = arena.ident
          w.conn.send(("copy", token, items))
        except OSError:
          self._fail(f"{w.describe_exit()} before it copied a batch's pixels")
          self._check()
        w.copies[token] = time.monotonic()
      wake = any(w.copies for w in unwatched) and self._wake_once()
    if wake:  # the pump watches a worker's socket only while it owes something
      os.write(self._wake, b"w")
    with self._cond:
      while any(token in w.copies for w in self._workers):
        self._check()
        self._cond.wait(_POLL_S)
      self._check()

  # -- the inline thread -------------------------------------------------------

  def _run_inline(self) -> None:
    while True:
      with self._cond:
        while not self._inline_queue and not self._closed:
          self._queued.wait()
        key = None if self._closed else self._inline_queue.popleft()
        self._inline_key, self._inline_since = key, time.monotonic()
        upcoming = {} if key is None else self._untaken(key)
      if key is None:  # an element computed ahead may have read ahead after `close` stopped it
        close_read_ahead(self._datasets)
        return
      for group, indices in upcoming.items():
        readahead.read_ahead_of(self._datasets[group], indices)
      cpu_s = time.thread_time()
      with storage.element_scope(self._abandoned) as spent, interpreter_exit.working():
        try:
          value = self._datasets[key[0]][key[1]]
        except BaseException as e:  # pylint: disable=broad-except  # re-raised by the caller
          value = _Failure(e)
      storage.COUNTS.add(self._names[key[0]], spent)
      with self._cond:
        self.inline_elements += 1
        self.inline_cpu_s += time.thread_time() - cpu_s
        self._inline_key = None
        self._done[key] = value
        self._cond.notify_all()
      del value  # a failure's traceback holds this frame: not kept till the next element

  def _give_back_freed_heap(self) -> None:
    """With workers, at most every `c_heap.TRIM_INTERVAL_S`, the pages freed in this
    process's malloc arenas go back to the kernel: its read-ahead and inline threads (the
    stragglers it computes behind a worker held up by a long element) each touch memory
    that their arena keeps once freed (the soak's main process grew by tens of MiB so)."""
    began = time.monotonic()
    c_heap.release_freed()
    done = time.monotonic()
    self._next_trim = done + c_heap.TRIM_INTERVAL_S
    self.heap_trims += 1
    self.heap_trim_s += done - began

  def _untaken(self, key: tuple[int, int]) -> dict[int, list[int]]:
    """Per group, the elements the inline thread is likely to compute next, whose reads it
    starts before computing `key`, as a worker reads ahead its own (the first batch waits
    on these): at its first element, every group's first ones, with or without workers
    (no worker is up yet; and without them, a group's records read ahead only once one
    of its elements is asked for, one group after the other: on a bucket, a round trip
    or three each); then, with workers, those of `key`'s group that no worker has taken
    (caller holds the lock)."""
    if not self._read_ahead_started:
      self._read_ahead_started = True
      return {g: [i for i in range(INLINE_READ_AHEAD) if (g, i) != key and i < len(d)]
              for g, d in enumerate(self._datasets)}
    if self._pump is None:  # each group's records read ahead of what is asked for
      return {}
    return {key[0]: [i for g, i in self._pending if g == key[0] and i > key[1]]
            [:INLINE_READ_AHEAD]}

  # -- the pump thread ---------------------------------------------------------

  def _run_pump(self) -> None:
    # One poll object, its descriptors changed only when the workers watched change:
    # `connection.wait` builds a selector and its keys in Python on every call, and the
    # pump makes one call per result.
    poller, polled = select.poll(), []
    poller.register(self._wake_reader, select.POLLIN)
    while True:
      with self._cond:
        if self._closed or self._failure is not None:
          return
        self._wake_pending = False  # what was wanted until now is dispatched below
        self._dispatch()
        self._check_deadlines()
        watched = [w for w in self._workers if w.jobs or w.copies or w.stage != "ready"]
      if watched != polled:
        for w in polled:
          if w not in watched:
            poller.unregister(w.conn.fileno())
            poller.unregister(w.process.sentinel)
        for w in watched:
          if w not in polled:
            poller.register(w.conn.fileno(), select.POLLIN)
            poller.register(w.process.sentinel, select.POLLIN)
        polled = watched
      ready = {fd for fd, _ in poller.poll(_POLL_S * 1000)}
      if self._wake_reader in ready:  # a wake or two (see _wake_once): all read at once
        os.read(self._wake_reader, 4096)
      for w in watched:
        if not self._receive(w, ready):
          return

  def _dispatch(self) -> None:
    """Hands each ready worker the pending elements it owns (`readahead.owner`): a worker
    reads ahead exactly the records it will decode, so each is read by one process. One
    message per worker: its new jobs, and the regions of its slab given back."""
    count = len(self._workers)
    room = [JOBS_PER_WORKER - len(w.jobs) if w.stage == "ready" else 0 for w in self._workers]
    new_jobs: list[list[tuple[int, int]]] = [[] for _ in self._workers]
    left = sum(room)
    for key in self._pending if left else ():  # one pass for all the workers
      n = readahead.owner(key[1], count)
      if len(new_jobs[n]) < room[n]:
        new_jobs[n].append(key)
        left -= 1
        if not left:
          break
    for w, jobs in zip(self._workers, new_jobs):
      if w.stage != "ready":
        continue
      freed = w.slab.take_freed() if w.slab is not None else []
      if not jobs and not freed:
        continue
      try:
        # (`conn.send` is this pickle through a `ForkingPickler` made per message)
        w.conn.send_bytes(pickle.dumps(("work", jobs, freed)))
      except OSError:  # the worker is gone
        if jobs:
          self._fail(f"{w.describe_exit()} before it was given work")
          return
        continue  # its exit is reported by the pump
      for key in jobs:
        del self._pending[key]
      if jobs and not w.jobs:
        w.since = time.monotonic()
      w.jobs.extend(jobs)

  def _check_deadlines(self) -> None:
    now = time.monotonic()
    start_timeout = max(self._timeout_s, _MIN_START_TIMEOUT_S)
    for w in self._workers:
      if w.stage != "ready" and now - w.since > start_timeout:
        self._fail(f"worker process {w.process.pid} did not finish starting within "
                   f"{start_timeout:g} s (stage: {w.stage}); its stderr may say why")
      elif w.copies and now - min(w.copies.values()) > self._timeout_s:
        self._fail(f"worker process {w.process.pid} did not copy a batch's pixels within "
                   f"element_timeout_s = {self._timeout_s:g} s (stopped, or starved of CPU)")
      elif w.jobs and now - w.since > self._timeout_s:
        self._fail(self._stalled(w.jobs[0], f"worker process {w.process.pid}"))

  def _receive(self, w: Worker, ready: set[int]) -> bool:
    """Takes in what `w` sent, or notices its exit (`ready`: the descriptors that are);
    False once the fetcher has failed."""
    if w.conn.fileno() in ready:
      try:
        if w.stage != "ready":
          message, *_, held = w.conn.recv()
          w.memory["at_" + message] = held
          return self._starting(w, message)
        status, key, value, spent, held = recv(w.conn, w.slab)
      except (EOFError, OSError):
        return self._exited(w)
      if status == "copied":  # `key` is the batch's token, `value` the copy's error
        with self._cond:
          w.copies.pop(key, None)
          if value is not None:
            self._fail(f"worker process {w.process.pid} failed to copy a batch's pixels:\n"
                       f"{value}")
            return False
          self._cond.notify_all()
        return True
      if held is not None:  # (None: as the last one it sent)
        w.memory["now"] = held
      storage.COUNTS.add(self._names[key[0]], spent)
      with self._cond:
        w.jobs.remove(key)
        w.since = time.monotonic()
        if status == "retry":  # storage gave up for now: raised once, computed again if asked
          value = _Failure(value)
        elif status == "error":
          self._fail(f"{self._describe(*key)} failed in worker process "
                     f"{w.process.pid}:\n{value}")
          return False
        self._done[key] = value
        if self._awaited == key or self._awaited is _DRAINING:
          self._cond.notify_all()
    elif w.process.sentinel in ready:
      return self._exited(w)
    return True

  def _starting(self, w: Worker, message: str) -> bool:
    """A start-up message: hello (then its datasets go out), failed, or ready."""
    with self._cond:
      w.since = time.monotonic()
      if message == "hello":
        w.stage = "loading"
        threading.Thread(target=self._hand_over, args=(w,), name="bagel-grain-start",
                         daemon=True).start()
      elif message == "ready":
        w.stage = "ready"
      else:
        try:
          detail = pickle.loads(w.conn.recv_bytes())
        except (EOFError, OSError):
          detail = "(its traceback was lost)"
        self._fail(f"worker process {w.process.pid} could not load the pipeline's datasets "
                   "(a module they need does not import in a fresh process, or an object "
                   f"does not unpickle):\n{detail}")
        return False
    return True

  def _hand_over(self, w: Worker) -> None:
    """Sends a worker its share of the elements and its datasets; blocks only this thread
    while the worker reads."""
    try:
      w.hand_over(self._workers.index(w), len(self._workers), self._payload)
    except (OSError, ValueError):
      pass  # the worker exited (the pump reports it) or the fetcher was closed

  def _exited(self, w: Worker) -> bool:
    with self._cond:
      if w.stage == "starting":
        exit_ = w.describe_exit()  # a missing guard exits with an error, never by a signal
        self._fail(f"{exit_} while starting, before it ran any bagel_grain code: " + (
            "killed from outside (or by the out-of-memory killer)" if w.killed_by_signal
            else GUARD_HINT) + ".")
      elif w.stage == "loading":
        self._fail(f"{w.describe_exit()} while loading the pipeline's datasets (killed, or "
                   "out of memory?)")
      elif w.jobs:
        self._fail(f"{w.describe_exit()} with {self._describe(*w.jobs[0])} in hand")
      elif w.copies:
        self._fail(f"{w.describe_exit()} while copying a batch's pixels")
      else:
        self._fail(f"{w.describe_exit()} while idle")
    return False

  def _fail(self, message: str) -> None:
    """Records the failure (caller holds the lock); the packer raises it on its next call."""
    if self._failure is None:
      self._failure = message
    self._cond.notify_all()
    self._queued.notify_all()

  # -- lifecycle ---------------------------------------------------------------

  def reset(self) -> None:
    """Forgets prefetched work (after a restore); work already handed out is drained."""
    self._check_owner()
    with self._cond:
      self._pending.clear()
      self._asked = [(-1, -1)] * len(self._datasets)
      self._inline_queue.clear()
      self._awaited = _DRAINING
      try:
        while self._failure is None and (
            self._inline_key is not None or any(w.jobs for w in self._workers)):
          self._check_inline_deadline()
          self._cond.wait(_POLL_S)
      finally:
        self._awaited = None
      self._done.clear()

  def close(self) -> None:
    """Stops the threads and the workers: asked first, then terminated; no process outlives it.

    In a forked child only the child's copies of the sockets are closed: the
    workers belong to the parent.
    """
    _LIVE.discard(self)
    if os.getpid() != self._pid:
      self._forget_workers()
      return
    with self._cond:
      if self._closed:
        return
      self._closed = True
      self._abandoned.set()
      self._cond.notify_all()
      self._queued.notify_all()
    if self._pump is not None:
      os.write(self._wake, b"w")
      self._pump.join()
      self._pump = None
      os.close(self._wake)
      os.close(self._wake_reader)
    workers, self._workers = self._workers, []
    for w in workers:
      try:
        w.conn.send(None)
      except (OSError, ValueError):
        pass
    deadline = time.monotonic() + 1.0  # one shared grace period, then terminate
    for w in workers:
      w.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
      if w.process.is_alive():  # e.g. blocked sending a result nobody will read
        w.process.terminate()
      w.process.join(timeout=2)
      if w.process.is_alive():
        w.process.kill()
        w.process.join()
      w.conn.close()
      w.close_slab()
    self._pending.clear()
    self._done.clear()
    close_read_ahead(self._datasets)
    if workers and not any(f._workers for f in _LIVE):  # (a restore's new fetcher may run)
      readahead.set_share((0, 1))

  def _forget_workers(self) -> None:
    """In a forked child: drop the parent's workers without touching them."""
    workers, self._workers = self._workers, []
    for w in workers:
      # Else the child's exit handler would terminate the parent's daemonic workers.
      multiprocessing.process._children.discard(w.process)  # pylint: disable=protected-access
      w.conn.close()
    if self._pump is not None:
      self._pump = None
      os.close(self._wake)
      os.close(self._wake_reader)


# Fetchers that may still own threads and processes: a forked child lets go of them.
_LIVE: weakref.WeakSet[Fetcher] = weakref.WeakSet()


def live() -> list[Fetcher]:
  """This process's fetchers not closed yet (the bench reads its workers' memory there)."""
  return list(_LIVE)


def _after_fork_in_child() -> None:
  for fetcher in list(_LIVE):
    fetcher._forget_workers()  # pylint: disable=protected-access


os.register_at_fork(after_in_child=_after_fork_in_child)
