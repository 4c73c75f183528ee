"""Batch buffers' pixels in shared memory, written by the workers that hold the samples.

A row carries about 24 MiB of pixels (bench budgets); copying them from the workers'
slabs into the batch was the main process's largest cost per row. So the pixel
arrays of batch buffers (`packing/buffers.py`) live in an arena, one anonymous
shared file (`memfd`, like a slab) cut into slots of one batch each, which every
worker maps (its descriptor goes to a worker before its first copy). The main
process writes the rows' token fields itself and, for each image whose pixels lie in
a worker's slab, sends that worker where they are and where they go (`Copies`); the
worker copies and acknowledges, and the batch is handed out only once every copy of
it is acknowledged. Pixels that lie elsewhere (decoded in the main process, or sent
over a socket) the main process copies as before.

A slot is given back once nothing references its arrays (a finalizer on each): its
pages are punched out of the file (zero again, and out of every process's memory).
A slot whose copies were never all acknowledged (a worker that died or stalled, a
Ctrl-C while waiting) is never used again: a worker may still write into it. The
sources stay referenced by `Copies` until the acknowledgements, so their slab
regions go back to the worker only after its copy.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from typing import Any, Mapping

import numpy as np

from bagel_grain.workers import slab as slabs

Where = tuple[int, tuple, tuple, str]  # (offset, shape, strides, dtype) in a mapping
_IDS = itertools.count(1)
NAME = "bagel-grain-batches"  # the arena's file, as /proc/PID/maps shows it ("memfd:" + NAME)


class Arena:
  """`slots` slots, each holding one array per name of `specs` (name: (shape, dtype))."""

  def __init__(self, fd: int, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
               slots: int):
    self._layout, offset = {}, 0
    for name, (shape, dtype) in specs.items():
      self._layout[name] = (offset, shape, np.dtype(dtype))
      nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
      offset += -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    self.slot_bytes, self.size = max(offset, mmap.PAGESIZE), max(offset, mmap.PAGESIZE) * slots
    os.ftruncate(fd, self.size)
    self._map = mmap.mmap(fd, self.size)
    self.fd, self.ident = fd, next(_IDS)  # the descriptor stays open: each worker gets a copy
    weakref.finalize(self, os.close, fd)
    whole = np.frombuffer(self._map, np.uint8)
    self._start = whole.ctypes.data
    del whole
    self._lock = threading.Lock()
    self._free = list(range(slots))[::-1]
    self._left: dict[int, int] = {}  # per slot taken: its arrays not yet collected
    self._copying: set[int] = set()  # slots with copies not yet acknowledged
    self.lost = 0  # slots never reused: copies into them were never acknowledged
    self.delegated = 0  # arrays copied by workers (for tests and reports)

  @classmethod
  def create(cls, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
             slots: int) -> Arena | None:
    """An arena, or None where the system has no memfd or no address space for it."""
    fd = slabs.create(mmap.PAGESIZE, NAME)
    if fd is None:
      return None
    try:
      return cls(fd, specs, slots)
    except (OSError, ValueError):
      os.close(fd)
      return None

  def take(self) -> tuple[int, dict[str, np.ndarray]] | None:
    """A free slot and its arrays (all zero), or None when every slot is taken. Each array is
    made from the mapping itself (its base is no array), so that `buffers.py`'s reference
    counts see every view of it."""
    with self._lock:
      if not self._free:
        return None
      slot = self._free.pop()
      self._left[slot] = len(self._layout)
    arrays = {}
    for name, (offset, shape, dtype) in self._layout.items():
      arrays[name] = np.ndarray(shape, dtype, self._map, slot * self.slot_bytes + offset)
      weakref.finalize(arrays[name], self._collected, slot)
    return slot, arrays

  def _collected(self, slot: int) -> None:
    with self._lock:
      self._left[slot] -= 1
      if self._left[slot]:
        return
      del self._left[slot]
      if slot in self._copying:
        self.lost += 1
        return
    try:  # zero again, and out of memory in every process
      self._map.madvise(mmap.MADV_REMOVE, slot * self.slot_bytes, self.slot_bytes)
    except (AttributeError, OSError, ValueError):
      self._map[slot * self.slot_bytes:(slot + 1) * self.slot_bytes] = bytes(self.slot_bytes)
    with self._lock:
      self._free.append(slot)

  def where(self, array: np.ndarray, address: int | None = None) -> Where | None:
    """`array` (at `address`, if known) as `(offset, shape, strides, dtype)` in the arena, or
    None if it lies elsewhere."""
    if address is None:
      address = slabs.address_of(array)
    if not self._start <= address < self._start + self.size:
      return None
    return address - self._start, array.shape, array.strides, array.dtype.str

  def copying(self, slot: int, busy: bool) -> None:
    """Marks the slot as written by workers (until every copy is acknowledged) or not."""
    with self._lock:
      (self._copying.add if busy else self._copying.discard)(slot)


class Copies:
  """One batch's copies: those whose source lies in a worker's slab go to that worker,
  the others are done here. `finish()` sends them and waits for every acknowledgement."""

  def __init__(self, arena: Arena, slot: int, fetcher: Any):
    self._arena, self._slot, self._fetcher = arena, slot, fetcher
    self._by_worker: dict[int, list[tuple[Where, Where]]] = {}
    self._sources: list[np.ndarray] = []  # their slab regions stay taken until acknowledged
    self._fills: list[tuple[Where, int, np.ndarray, Any]] = []

  def copy(self, destination: np.ndarray, source: np.ndarray) -> None:
    """`destination[...] = source`, here or by the worker whose slab holds `source`; a
    scalar `source` (a fill) by one of the workers that copy this batch, if any."""
    if not destination.size:
      return
    to = self._arena.where(destination)
    if to is not None and not isinstance(source, np.ndarray):
      self._fills.append((to, source.item(), destination, source))
      return
    found = self._fetcher.slab_of(source) if to is not None else None
    if found is None:
      destination[...] = source
      return
    worker, at = found
    self._by_worker.setdefault(worker, []).append((to, at))
    self._sources.append(source)

  def finish(self) -> None:
    """Sends each worker its copies and waits until all are done (a WorkerError if a worker
    dies, fails or stalls; the slot is then never used again)."""
    if not self._by_worker:  # no worker to ask: the fills are done here
      for _, _, destination, value in self._fills:
        destination[...] = value
      self._fills.clear()
      return
    first = next(iter(self._by_worker.values()))
    first[:0] = [(to, value) for to, value, _, _ in self._fills]
    self._fills.clear()
    self._arena.copying(self._slot, True)
    self._fetcher.copy_and_wait(self._arena, self._by_worker)
    self._arena.copying(self._slot, False)
    self._arena.delegated += sum(len(c) for c in self._by_worker.values())
    self._by_worker.clear()
    self._sources.clear()
