"""Worker processes: how one is spawned, started and told its jobs, and the wire format
of its results (a prepared sample as a struct header, `workers/sample_wire.py`, anything
else as pickle protocol 5; arrays out of band either way: in the worker's shared-memory
slab, `workers/slab.py`, or where it has no room, over the worker's socket).

Start-up: a worker is spawned with nothing but its socket (multiprocessing writes
the process object into a pipe and blocks until the child reads it: a child that
dies first, e.g. re-running a script without a `__main__` guard, would block the
parent forever). It reports once it runs our code, and only then do the datasets,
pickled once, go over its socket (`Fetcher` sends them from a thread of its own).
Workers ignore SIGINT (the main process decides what a Ctrl-C means), run at a
lower priority, and leave quietly when the main process goes away.

Messages to a worker: its share and slab size, its datasets, the slab itself (a file
descriptor), then `("work", jobs, freed)` (elements to compute, as `(group, index)`,
and the regions of its slab the main process let go of), `("arena", size)` followed
by a descriptor (the batch buffers' shared pixels, `workers/arena.py`), `("copy",
token, copies)` (pixels of its slab to copy into the arena: the worker answers
`("copied", token, error)`), or None (stop). The worker reads them on its main
thread, which also does the copies, and computes its jobs on a thread of its own,
so a copy never waits behind a decode.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import multiprocessing.reduction
import multiprocessing.resource_tracker
import os
import pickle
import signal
import queue
import socket
import struct
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bagel_grain import c_heap, held_memory, interpreter_exit, storage
from bagel_grain.workers import entry, sample_wire, slab as slabs
from bagel_grain.sources import readahead
from bagel_grain.errors import BagelGrainError, StorageUnavailableError

_SIZE = struct.Struct("!i")  # a `Connection` frame's size (-1: an 8-byte size follows)
_LONG_SIZE = struct.Struct("!Q")
_SOCKET_BUFFER = 4 << 20
WORKER_NICENESS = 10  # added to the main process's niceness for each worker
GUARD_HINT = (
    "the script that builds the pipeline probably lacks an `if __name__ == \"__main__\":` "
    "guard (worker processes are spawned: each re-imports the main script, and an "
    "unguarded script starts the pipeline again there), or the script fails to import "
    "in a fresh process. The worker's traceback is on stderr")


class WorkerError(BagelGrainError):
  """A worker process died, failed or stalled: the stream cannot continue."""


_HELD_EVERY_S = 1.0  # a report's figure, not worth a /proc read per element
_held: tuple[float, dict[str, int] | None] = (-_HELD_EVERY_S, None)


def _held_memory() -> dict[str, int] | None:
  """`held_memory.snapshot()`, taken again at most once a second; None while the last one
  returned stands (the main process keeps the last it received)."""
  global _held  # pylint: disable=global-statement
  if time.monotonic() - _held[0] < _HELD_EVERY_S:
    return None
  _held = (time.monotonic(), held_memory.snapshot())
  return _held[1]


def send(conn: Connection, status: str, job: tuple[int, int], value: Any,
         spent: storage.ElementStorage, slab: slabs.WorkerSlab | None = None,
         lock: threading.Lock | None = None) -> None:
  """A prepared sample as a struct header and its arrays' buffers (`sample_wire`), anything
  else as pickle protocol 5 with the arrays' buffers out of band: the buffers copied once
  into `slab` when it has room (the main process maps it), else sent over the socket.

  `status` is "ok" (value: the element), "retry" (value: the StorageUnavailableError
  that a later attempt may not meet) or "error" (value: a traceback, the stream stops);
  `spent` is what storage cost computing it. The header also carries where the buffers
  lie in the slab (or None) and what the worker holds (`held_memory.snapshot()`, taken
  at most once a second; None in between), for reports."""
  encoded = sample_wire.encode(value) if status == "ok" else None
  if encoded is not None:
    payload, buffers = encoded
  else:
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
  placed = slab.place(buffers) if slab is not None and buffers else None
  with lock or contextlib.nullcontext():  # the copies' acknowledgements share the socket
    conn.send((status, job, len(buffers), spent.retries, spent.wait_s, placed, _held_memory(),
               payload))  # one message: with the arrays placed, a few KiB
    if placed is None:
      for buffer in buffers:
        conn.send_bytes(buffer.raw())


def _message(conn: Connection) -> Any:
  """`conn.recv()`: the same frame (a 4-byte big-endian size, then the pickle) read with a
  plain read per part, as the pump reads a dozen a row (`Connection` makes a `BytesIO`
  per read)."""
  fd = conn.fileno()
  (size,) = _SIZE.unpack(_read(fd, 4, start=True))
  if size == -1:
    (size,) = _LONG_SIZE.unpack(_read(fd, 8))
  return pickle.loads(_read(fd, size))


def _read(fd: int, size: int, *, start: bool = False) -> bytes:
  """Exactly `size` bytes of `fd`: EOFError at its end before a message (`start`), as
  `Connection` raises it, OSError within one."""
  data = os.read(fd, size)
  if len(data) == size:
    return data
  parts = [data]
  got = len(data)
  while data and got < size:
    data = os.read(fd, size - got)
    parts.append(data)
    got += len(data)
  if got < size:
    if start and not got:
      raise EOFError
    raise OSError("got end of file during message")
  return b"".join(parts)


def recv(conn: Connection, slab: slabs.MainSlab | None = None
         ) -> tuple[str, tuple[int, int], Any, storage.ElementStorage, dict[str, int]]:
  """What `send` sent: status, job, value, storage cost, and the worker's memory held.
  The value's arrays are read-only views of the slab, or of the bytes received.
  A copy's acknowledgement is status "copied", its token and its error (None)."""
  header = _message(conn)
  if header[0] == "copied":
    return "copied", header[1], header[2], storage.ElementStorage(0, 0.0), None
  status, job, count, retries, wait_s, placed, held, payload = header
  if placed is not None and sample_wire.is_sample(payload):
    value = sample_wire.decode(payload, *slab.region(placed))
  else:
    buffers = slab.buffers(placed) if placed is not None else [
        conn.recv_bytes() for _ in range(count)]
    if sample_wire.is_sample(payload):
      value = sample_wire.decode(payload, buffers)
    else:
      value = pickle.loads(payload, buffers=buffers)
  return status, tuple(job), value, storage.ElementStorage(retries, wait_s), held


def _widen(conn: Connection) -> None:
  """Raises the socket's buffers, so a result of a few MiB crosses in a few writes."""
  try:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
      for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
  except OSError:
    pass  # the system's limit stands; only slower


def _worker_main(conn: Connection) -> None:
  """A worker: says hello, loads its datasets, then computes (group, index) jobs.

  It stops when told to (None) or when the main process is gone (end-of-file or a
  broken socket), without a traceback either way.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by our parent at spawn
  signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the re-imported main script set
  c_heap.limit_arenas()
  c_heap.reuse_freed_blocks()
  try:
    _widen(conn)
    conn.send(("hello", None, 0, 0, 0.0, held_memory.snapshot()))  # RSS after imports
    try:
      share, count, slab_bytes = conn.recv()
      readahead.set_share((share, count))  # the elements this worker decodes
      datasets = pickle.loads(conn.recv_bytes())
      slab = slabs.worker_side(multiprocessing.reduction.recv_handle(conn), slab_bytes
                               ) if slab_bytes else None
    except (EOFError, OSError):
      return
    except BaseException:  # pylint: disable=broad-except  # reported, then this worker ends
      conn.send(("failed", None, 0, 0, 0.0, {}))
      conn.send_bytes(pickle.dumps(traceback.format_exc()))
      return
    conn.send(("ready", None, 0, 0, 0.0, held_memory.snapshot()))  # and datasets loaded
    lock, jobs = threading.Lock(), queue.SimpleQueue()
    threading.Thread(target=_compute, args=(conn, datasets, slab, lock, jobs), daemon=True,
                     name="bagel-grain-compute").start()
    arena = None
    while True:
      message = conn.recv()
      if message is None:
        return
      if message[0] == "work":
        _, work, freed = message
        if freed:
          slab.free(freed)
        for job in work:
          jobs.put(job)
      elif message[0] == "arena":
        fd = multiprocessing.reduction.recv_handle(conn)
        try:
          arena = mmap.mmap(fd, message[1])
        finally:
          os.close(fd)
      elif message[0] == "copy":
        _, token, copies = message
        error = _copy(copies, slab, arena)
        with lock:
          conn.send(("copied", token, error))
  except (EOFError, OSError):
    return  # the main process closed our socket or went away


def _compute(conn: Connection, datasets, slab: slabs.WorkerSlab | None, lock: threading.Lock,
             jobs: queue.SimpleQueue) -> None:
  """The worker's jobs, one after the other, each result sent as soon as it is made."""
  try:
    while True:
      job = jobs.get()
      group, index = job
      # (a daemon thread: the exit waits for it to leave pyarrow, see interpreter_exit)
      with storage.element_scope() as spent, interpreter_exit.working():
        try:
          status, value = "ok", datasets[group][index]
        except StorageUnavailableError as e:  # the main process raises it; a retry may pass
          status, value = "retry", e
        except Exception:  # pylint: disable=broad-except  # reported, then the stream stops
          status, value = "error", traceback.format_exc()
      send(conn, status, job, value, spent, slab, lock)
  except (EOFError, OSError):
    os._exit(0)  # the main process closed our socket or went away
  except BaseException:  # pylint: disable=broad-except  # e.g. a result that does not pickle
    traceback.print_exc()
    os._exit(1)  # the process ends, as when one thread did everything: the pump reports it


def _copy(copies, slab: slabs.WorkerSlab | None, arena: mmap.mmap | None) -> str | None:
  """Copies arrays of the slab into the arena: each `(destination, source)` an array's
  `(offset, shape, strides, dtype)` in its mapping (numpy checks that it lies inside), or
  a number to fill the destination with. None when done, else what failed (the main
  process fails the stream with it)."""
  try:
    for (d_off, d_shape, d_strides, d_type), source in copies:
      destination = np.ndarray(d_shape, d_type, arena, d_off, d_strides)
      if isinstance(source, (int, float)):
        destination[...] = source
      else:
        s_off, s_shape, s_strides, s_type = source
        destination[...] = np.ndarray(s_shape, s_type, slab.memory, s_off, s_strides)
    return None
  except Exception:  # pylint: disable=broad-except  # reported by the main process
    return traceback.format_exc()


def _lower_priority(pid: int) -> None:
  """Workers run `WORKER_NICENESS` below the main process: they work ahead, while the
  main process (packer, trainer) is the critical path. On a host with fewer free cores
  than processes, starting workers then no longer slow the main process's first batch."""
  try:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, pid, min(19, mine + WORKER_NICENESS))
  except OSError:
    pass  # the system refuses: the worker keeps our priority, only slower to start


class Worker:
  """A worker process and what the pump knows of it."""

  def __init__(self, ctx):
    self.conn, child = ctx.Pipe()
    self.process = ctx.Process(target=entry.worker_main, args=(child,), daemon=True)
    self.process.start()
    _lower_priority(self.process.pid)
    child.close()
    _widen(self.conn)
    self.stage = "starting"  # -> "loading" (said hello) -> "ready" (datasets loaded)
    self.since = time.monotonic()  # start of the current stage, or of the job in hand
    self.jobs: collections.deque[tuple[int, int]] = collections.deque()
    self.memory: dict[str, dict[str, int]] = {}  # see Fetcher.worker_memory
    self.copies: dict[int, float] = {}  # batches' copies it owes: token -> when sent
    self.arena: int | None = None  # the arena it maps (`workers/arena.py`)
    # Its slab: this process maps it now; the descriptor goes to the worker at hand-over.
    self.slab_fd = slabs.create()
    self.slab = slabs.main_side(self.slab_fd, slabs.SLAB_BYTES)
    if self.slab is None and self.slab_fd is not None:  # no room to map it: the socket only
      os.close(self.slab_fd)
      self.slab_fd = None

  def hand_over(self, share: int, count: int, payload: bytes) -> None:
    """Sends the worker its share of the elements, its datasets and its slab; blocks until
    the worker has read them (call from a thread of its own)."""
    fd, self.slab_fd = self.slab_fd, None
    try:
      self.conn.send((share, count, slabs.SLAB_BYTES if fd is not None else 0))
      self.conn.send_bytes(payload)
      if fd is not None:
        multiprocessing.reduction.send_handle(self.conn, fd, self.process.pid)
    finally:
      if fd is not None:
        os.close(fd)  # the worker holds its own; the mapping here stays

  def close_slab(self) -> None:
    """Lets go of the slab here: its descriptor if never handed over; the mapping stays
    until the last array that views it is gone."""
    if self.slab_fd is not None:
      os.close(self.slab_fd)
      self.slab_fd = None
    self.slab = None


  def describe_exit(self) -> str:
    self.process.join(timeout=1)  # so that its exit code is known
    code = self.process.exitcode
    if code is not None and code < 0:  # what was observed: a signal, not a Python exit
      try:
        name = signal.Signals(-code).name
      except ValueError:
        name = f"signal {-code}"
      return f"worker process {self.process.pid} was killed by {name} (exit code {code})"
    return f"worker process {self.process.pid} exited (exit code {code})"

  @property
  def killed_by_signal(self) -> bool:
    return self.process.exitcode is not None and self.process.exitcode < 0


def start_workers(ctx, count: int) -> list[Worker]:
  """Spawns workers with SIGINT blocked, so that they inherit it blocked until they ignore it."""
  # Spawning the resource tracker unblocks SIGINT in this thread: let that happen first.
  multiprocessing.resource_tracker.ensure_running()
  old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    return [Worker(ctx) for _ in range(count)]
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
