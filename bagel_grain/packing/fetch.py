"""Elements of the groups' MapDatasets by index, computed ahead by worker processes.

Each group is consumed in index order, so the fetcher keeps a window of the next
indices of every group in flight. Results are addressed by (group, index), never
by arrival order: the packed stream is the same for any number of workers. When
the element the packer needs has not been handed to a worker yet (workers still
starting, or all busy), the main process computes it itself instead of waiting:
the first batch does not wait for worker start-up.

A thread of the main process (the pump) hands jobs to the workers and drains their
results as soon as they are sent, so a worker never waits on a busy packer. Each
worker has a pipe of its own (not a shared result queue): a worker that dies,
even halfway through sending a result, closes the only writer of its pipe, so the
pump sees end-of-file or the process sentinel and the packer gets a WorkerError
instead of hanging. After that the fetcher stays failed.
"""

from __future__ import annotations

import collections
import multiprocessing
import pickle
import socket
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from bagel_grain.errors import BagelGrainError
from bagel_grain.sources.readahead import close_read_ahead

_JOBS_PER_WORKER = 4  # handed out ahead, so a worker never idles between results
_POLL_S = 1.0
_SOCKET_BUFFER = 4 << 20


class WorkerError(BagelGrainError):
  """A worker process died or failed: the stream cannot continue."""


def _send(conn: Connection, status: str, job: tuple[int, int], value: Any) -> None:
  """Pickle protocol 5 with the arrays' buffers sent out of band: no copy into the pickle."""
  buffers: list[pickle.PickleBuffer] = []
  payload = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
  conn.send((status, job, len(buffers)))
  conn.send_bytes(payload)
  for buffer in buffers:
    conn.send_bytes(buffer.raw())


def _recv(conn: Connection) -> tuple[str, tuple[int, int], Any]:
  status, job, count = conn.recv()
  payload = conn.recv_bytes()
  buffers = [conn.recv_bytes() for _ in range(count)]
  return status, tuple(job), pickle.loads(payload, buffers=buffers)  # arrays view the bytes


def _widen(conn: Connection) -> None:
  """Raises the socket's buffers, so a result of a few MiB crosses in a few writes."""
  try:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
      for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
  except OSError:
    pass  # the system's limit stands; only slower


def _worker_main(conn: Connection, datasets: Sequence[Any]) -> None:
  """A worker: computes (group, index) jobs until told to stop (None) or the pipe closes."""
  _widen(conn)
  conn.send(("ready", None, 0))  # imports and datasets unpickled: it may be given work
  while True:
    try:
      job = conn.recv()
    except (EOFError, OSError):
      return
    if job is None:
      return
    group, index = job
    try:
      value = datasets[group][index]
    except Exception:  # pylint: disable=broad-except  # reported, then the stream stops
      conn.send(("error", job, 0))
      conn.send_bytes(pickle.dumps(traceback.format_exc()))
      continue
    _send(conn, "ok", job, value)


class _Worker:
  def __init__(self, ctx, datasets):
    self.conn, child = ctx.Pipe()
    self.process = ctx.Process(target=_worker_main, args=(child, datasets), daemon=True)
    self.process.start()
    child.close()
    _widen(self.conn)
    self.jobs: collections.deque[tuple[int, int]] = collections.deque()
    self.ready = False  # until it says so, its work is done by the main process


class Fetcher:
  """`get(group, index)`: the element, from `workers` processes or inline (0)."""

  def __init__(self, datasets: Sequence[Any], *, workers: int, depths: Sequence[int]):
    self._datasets = list(datasets)
    self._depths = list(depths)
    self._pending: dict[tuple[int, int], None] = {}  # wanted, not yet handed out (ordered)
    self._done: dict[tuple[int, int], Any] = {}
    self._workers: list[_Worker] = []
    self._failure: str | None = None
    self._cond = threading.Condition()
    self._pump: threading.Thread | None = None
    if workers > 0:
      ctx = multiprocessing.get_context("spawn")
      self._workers = [_Worker(ctx, self._datasets) for _ in range(workers)]
      self._wake_reader, self._wake = ctx.Pipe(duplex=False)
      self._stopping = False
      self._pump = threading.Thread(target=self._run_pump, name="bagel-grain-fetch",
                                    daemon=True)
      self._pump.start()

  # -- the packer's side -------------------------------------------------------

  def get(self, group: int, index: int) -> Any:
    if self._pump is None and self._failure is None:
      return self._datasets[group][index]
    with self._cond:
      for ahead in range(self._depths[group] + 1):
        self._want(group, index + ahead)
    self._wake.send_bytes(b"")
    return self._take((group, index))

  def get_many(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
    """Several elements at once (a restore's buffer), computed in parallel."""
    keys = [(int(g), int(i)) for g, i in keys]
    if self._pump is None and self._failure is None:
      return [self._datasets[g][i] for g, i in keys]
    with self._cond:
      for key in keys:
        self._want(*key)
    self._wake.send_bytes(b"")
    return [self._take(key) for key in keys]

  def _want(self, group: int, index: int) -> None:
    key = (group, index)
    if index < len(self._datasets[group]) and key not in self._done and not any(
        key in w.jobs for w in self._workers):
      self._pending.setdefault(key, None)

  def _take(self, key: tuple[int, int]) -> Any:
    with self._cond:
      while True:
        self._check()
        if key in self._done:
          return self._done.pop(key)
        if not any(key in w.jobs for w in self._workers):
          self._pending.pop(key, None)  # no worker has it: do it here rather than wait
          break
        self._cond.wait()
    return self._datasets[key[0]][key[1]]

  def _check(self) -> None:
    if self._failure is not None:
      raise WorkerError(self._failure)

  # -- the pump thread ---------------------------------------------------------

  def _run_pump(self) -> None:
    while True:
      with self._cond:
        if self._stopping or self._failure is not None:
          return
        self._dispatch()
        busy = [w for w in self._workers if w.jobs or not w.ready]
      waiting = [self._wake_reader] + [w.conn for w in busy] + [w.process.sentinel for w in busy]
      ready = wait(waiting, _POLL_S)
      if self._wake_reader in ready:
        while self._wake_reader.poll():
          self._wake_reader.recv_bytes()
      for w in busy:
        if not self._receive(w, ready):
          return

  def _dispatch(self) -> None:
    for w in self._workers:
      while w.ready and self._pending and len(w.jobs) < _JOBS_PER_WORKER:
        key = next(iter(self._pending))
        del self._pending[key]
        try:
          w.conn.send(key)
        except OSError:  # the worker is gone
          w.process.join(timeout=1)
          self._fail(f"worker process {w.process.pid} died (exit code "
                     f"{w.process.exitcode}) before it was given work")
          return
        w.jobs.append(key)

  def _receive(self, w: _Worker, ready: list) -> bool:
    """Takes in `w`'s result if it sent one; False once the fetcher has failed."""
    if w.conn in ready and not w.ready:
      try:
        w.ready = w.conn.recv()[0] == "ready"
        return True
      except (EOFError, OSError):
        w.process.join(timeout=1)
        with self._cond:
          self._fail(f"worker process {w.process.pid} died while starting (exit code "
                     f"{w.process.exitcode})")
        return False
    if w.conn in ready:
      try:
        status, key, value = _recv(w.conn)
      except (EOFError, OSError):
        w.process.join(timeout=1)
        with self._cond:
          self._fail(f"worker process {w.process.pid} died (exit code "
                     f"{w.process.exitcode}) while decoding group {w.jobs[0][0]} element "
                     f"{w.jobs[0][1]}")
        return False
      with self._cond:
        w.jobs.remove(key)
        if status == "error":
          self._fail(f"group {key[0]} element {key[1]} failed in a worker:\n{value}")
          return False
        self._done[key] = value
        self._cond.notify_all()
    elif w.process.sentinel in ready:
      w.process.join(timeout=1)  # so that its exit code is known
      doing = f"group {w.jobs[0][0]} element {w.jobs[0][1]}" if w.jobs else "no element"
      with self._cond:
        self._fail(f"worker process {w.process.pid} died (exit code {w.process.exitcode}) "
                   f"with {doing} in hand")
      return False
    return True

  def _fail(self, message: str) -> None:
    """Records the failure (caller holds the lock); the packer raises it on its next call."""
    if self._failure is None:
      self._failure = message
    self._cond.notify_all()

  # -- lifecycle ---------------------------------------------------------------

  def reset(self) -> None:
    """Forgets prefetched work (after a restore); jobs already handed out are drained."""
    with self._cond:
      self._pending.clear()
      self._done.clear()
      while any(w.jobs for w in self._workers) and self._failure is None:
        self._cond.wait()
      self._done.clear()

  def close(self) -> None:
    """Stops the pump and the workers: asked first, then terminated; no process outlives it."""
    if self._pump is not None:
      with self._cond:
        self._stopping = True
      self._wake.send_bytes(b"")
      self._pump.join()
      self._pump = None
      self._wake.close()
      self._wake_reader.close()
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
    self._pending.clear()
    close_read_ahead(self._datasets)
