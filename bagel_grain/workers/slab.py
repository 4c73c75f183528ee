"""Shared-memory slabs: a worker's arrays reach the main process as places in memory both
map, not as bytes through a socket.

Each worker has one slab, an anonymous shared file (`memfd`) that the main process
creates and passes over the worker's socket at start-up. The worker copies an
element's out-of-band pickle buffers (its arrays: pixels, token ids) into a free
region of it and sends only the pickle and where the buffers lie; the main process
unpickles them as read-only views of its own mapping: no copy, no page of fresh
memory. A region goes back to the worker once nothing in the main process
references any array of its element (a weak reference to the region, which every view
keeps alive), and the pump tells the worker so with its next message.

A slab has no name: the kernel frees it when the last process that maps it is gone,
so a kill -9 of a worker or of the main process leaves nothing in /dev/shm and needs
no resource tracker. Where `memfd_create` is missing, a slab cannot be mapped (no
address space left), or a region does not fit (the packer holding many samples), the
element goes through the socket as before: the slab saves copies, it never decides
what is sent.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import pickle
import threading
import weakref
from typing import Sequence

import numpy as np

SLAB_BYTES = 128 << 20  # per worker: at most this much more in its RSS (and in the main process's)
# The first bytes of a slab stay resident once touched (first fit keeps most regions
# there, and pages already mapped cost the main process no fault); a region freed beyond
# them gives its pages back to the kernel, so that a burst of samples held (a full
# packer's buffer) does not stay in both processes' RSS.
WARM_BYTES = 64 << 20
_ALIGN = 64  # each buffer starts on a cache line (and on any dtype's alignment)

Spans = tuple[tuple[int, int], ...]  # (offset within the region, bytes) per buffer
Placed = tuple[int, Spans]  # (the region's start in the slab, its buffers)


def create(size: int = SLAB_BYTES, name: str = "bagel-grain-slab") -> int | None:
  """A new slab's file descriptor (close-on-exec), or None where the system has no memfd."""
  if not hasattr(os, "memfd_create"):
    return None
  try:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
  except OSError:
    return None
  try:
    os.ftruncate(fd, size)
  except OSError:
    os.close(fd)
    return None
  return fd


class Regions:
  """First-fit allocation of byte ranges of a slab; freed ranges merge with their neighbours."""

  def __init__(self, size: int):
    self._starts, self._lengths = [0], [size]  # free ranges, sorted by start
    self._taken: dict[int, int] = {}

  def take(self, nbytes: int) -> int | None:
    """The start of a free range of `nbytes` (at the lowest address that fits), or None."""
    nbytes = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    for i, length in enumerate(self._lengths):
      if length >= nbytes:
        start = self._starts[i]
        if length == nbytes:
          del self._starts[i], self._lengths[i]
        else:
          self._starts[i], self._lengths[i] = start + nbytes, length - nbytes
        self._taken[start] = nbytes
        return start
    return None

  def free(self, start: int) -> int:
    """Frees the range taken at `start`; returns its length."""
    nbytes = freed = self._taken.pop(start)
    i = bisect.bisect(self._starts, start)
    if i < len(self._starts) and start + nbytes == self._starts[i]:  # joins the next
      nbytes += self._lengths[i]
      del self._starts[i], self._lengths[i]
    if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # joins the previous
      self._lengths[i - 1] += nbytes
    else:
      self._starts.insert(i, start)
      self._lengths.insert(i, nbytes)
    return freed

  @property
  def taken_bytes(self) -> int:
    return sum(self._taken.values())


class WorkerSlab:
  """The worker's side: its element's buffers copied into a free region."""

  def __init__(self, fd: int, size: int, warm: int | None = None):
    self._map = mmap.mmap(fd, size)
    os.close(fd)  # the mapping keeps the memory
    self._view = memoryview(self._map)
    self._regions = Regions(size)
    self._warm = WARM_BYTES if warm is None else warm
    self._lock = threading.Lock()  # regions are placed by the compute thread, freed by the reader

  @property
  def memory(self) -> mmap.mmap:
    """The mapping, for the copies into batch buffers the main process asks for."""
    return self._map

  def place(self, buffers: Sequence[pickle.PickleBuffer]) -> Placed | None:
    """Where `buffers` now lie, or None when no free region is large enough."""
    raws = [b.raw() for b in buffers]
    spans, end = [], 0
    for raw in raws:
      spans.append((end, raw.nbytes))
      end += -(-raw.nbytes // _ALIGN) * _ALIGN
    with self._lock:
      start = self._regions.take(end)
    if start is None:
      return None
    for raw, (offset, nbytes) in zip(raws, spans):
      self._view[start + offset:start + offset + nbytes] = raw
    return start, tuple(spans)

  def free(self, starts: Sequence[int]) -> None:
    """Frees the regions; the whole pages of them beyond the warm bytes go back to the kernel
    (MADV_REMOVE: gone from the main process's mapping too)."""
    for start in starts:
      with self._lock:  # its pages gone before the compute thread can place anything there
        end = start + self._regions.free(start)
        first = -(-max(start, self._warm) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and hasattr(mmap, "MADV_REMOVE"):
          try:
            self._map.madvise(mmap.MADV_REMOVE, first, last - first)
          except OSError:
            pass  # kept resident: only memory, never the data


def address_of(array: np.ndarray) -> int:
  """The address of `array`'s first byte (a microsecond or two: asked once per copy, not
  once per mapping it is looked for in)."""
  return array.__array_interface__["data"][0]


class MainSlab:
  """The main process's side: a read-only mapping, elements' buffers as views of it, and the
  regions nothing references any more (`take_freed`), for the pump to give back."""

  def __init__(self, fd: int, size: int):
    self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    self._freed: collections.deque[int] = collections.deque()
    # Per region handed out, by its weak reference's id: the reference and the region's
    # start (a reference and a callback cost a third of a `weakref.finalize`, one a sample).
    self._held: dict[int, tuple[weakref.ref, int]] = {}
    whole = np.frombuffer(self._map, np.uint8)
    self._start, self._end = whole.ctypes.data, whole.ctypes.data + size
    del whole  # (an array of it would keep the mapping from ever closing)

  def where(self, array: np.ndarray, address: int | None = None
            ) -> tuple[int, tuple, tuple, str] | None:
    """`array` (at `address`, if known: `address_of`) as `(offset, shape, strides, dtype)` in
    this slab, or None when it lies elsewhere (the worker can then build the same array
    from its own mapping)."""
    if address is None:
      address = address_of(array)
    if not self._start <= address < self._end:
      return None
    return address - self._start, array.shape, array.strides, array.dtype.str

  def buffers(self, placed: Placed) -> list[np.ndarray]:
    """The buffers of an element placed at `placed`: read-only views that keep its region
    (whose start is queued for `take_freed` once the last of them is gone)."""
    region, _ = self.region(placed)
    return [region[offset:offset + nbytes] for offset, nbytes in placed[1]]

  def region(self, placed: Placed) -> tuple[np.ndarray, list[int]]:
    """The region of an element placed at `placed`, as one read-only array of bytes that
    keeps it (as `buffers` does), and where each buffer starts in it."""
    start, spans = placed
    end = spans[-1][0] + spans[-1][1] if spans else 0
    # Made from the mapping, not sliced from an array of it: numpy gives a view of a view
    # the first array as its base, and only an array whose base is no array stays the base
    # of its slices (and of what unpickling makes of them).
    region = np.frombuffer(self._map, np.uint8, count=end, offset=start)
    ref = weakref.ref(region, self._collected)
    self._held[id(ref)] = ref, start
    return region, [offset for offset, _ in spans]

  def _collected(self, ref: weakref.ref) -> None:
    self._freed.append(self._held.pop(id(ref))[1])

  def take_freed(self) -> list[int]:
    out = []
    while self._freed:
      out.append(self._freed.popleft())
    return out


def main_side(fd: int | None, size: int) -> MainSlab | None:
  """The main process's mapping of a slab, or None (no slab, or no address space for it,
  e.g. under a tight RLIMIT_AS): its worker then sends everything over its socket."""
  if fd is None:
    return None
  try:
    return MainSlab(fd, size)
  except OSError:
    return None


def worker_side(fd: int, size: int) -> WorkerSlab | None:
  """The worker's mapping of the slab it was handed (the descriptor is closed either way),
  or None when it cannot map it: it then sends everything over its socket."""
  try:
    return WorkerSlab(fd, size)
  except OSError:
    os.close(fd)
    return None
