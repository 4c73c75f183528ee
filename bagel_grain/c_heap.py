"""What glibc's malloc keeps after our threads free it, given back to the kernel.

glibc gives each thread that meets contention its own arena (up to 8 per core), and an
arena keeps the memory freed in it for later. A pipeline's threads (read-ahead, pump,
decoding) each touch tens of MiB per element at times, so the memory freed but kept grew
with every new high point: in the 10-minute soak the main process's C heap in use stayed
at 140 MiB while what it kept went from 51 to 132 MiB. Two remedies, both no-ops where
the C library is not glibc:

- our own worker processes use at most `WORKER_ARENAS` arenas (set as they start, before
  their threads): a host's process is not ours to configure, a worker is;
- every process of a pipeline hands back what its arenas keep (`malloc_trim`) at most
  once every `TRIM_EVERY_S` seconds, from the loop that produces its output. That
  changes no setting: it is what a process would get from a smaller high point.
"""

from __future__ import annotations

import ctypes
import threading
import time

WORKER_ARENAS = 2
TRIM_EVERY_S = 10.0
_M_ARENA_MAX = -8  # mallopt's parameter, from glibc's malloc.h


def _glibc():
  try:
    libc = ctypes.CDLL(None)
    libc.malloc_trim, libc.mallopt  # pylint: disable=pointless-statement
    return libc
  except (OSError, AttributeError):
    return None  # another C library (musl, macOS): nothing to do


_LIBC = _glibc()


def limit_arenas(count: int = WORKER_ARENAS) -> bool:
  """At most `count` malloc arenas in this process from now on (a worker's first step)."""
  return bool(_LIBC is not None and _LIBC.mallopt(_M_ARENA_MAX, count))


def trim() -> bool:
  """Gives back to the kernel the free memory every arena keeps; whether any was."""
  return bool(_LIBC is not None and _LIBC.malloc_trim(0))


class Trimmer:
  """Calls `trim` at most once every `every_s` seconds, however often it is asked."""

  def __init__(self, every_s: float = TRIM_EVERY_S):
    self._every_s = every_s
    self._next = time.monotonic() + every_s
    self._lock = threading.Lock()

  def maybe_trim(self) -> bool:
    """Trims if the period has passed since the last trim; whether memory was given back."""
    now = time.monotonic()
    if now < self._next or not self._lock.acquire(blocking=False):
      return False
    try:
      self._next = now + self._every_s
      return trim()
    finally:
      self._lock.release()


_PROCESS = Trimmer()


def maybe_trim() -> bool:
  """This process's `Trimmer`: one period however many pipelines ask."""
  return _PROCESS.maybe_trim()
