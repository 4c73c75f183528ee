"""Batch buffers reused once released: rows written into pages already touched.

A fresh batch is mostly zero pages (a row at the bench's budgets is about 80 MiB,
most of it VAE image slots): writing into it costs a page fault per 4 KiB, which
was the main process's largest cost. So batches are written into a few buffers
kept here, and each row resets only what the buffer's previous row wrote and the
new one does not overwrite (`row.write_row`'s `previous`).

The contract (the first rule: nothing corrupted silently):
- A buffer is written again only when nothing outside this pool references any of
  its arrays: not the batch dict, not an array taken out of it, not a view or a
  slice of one (a view holds its base), not a `memoryview`, not a `jax.Array`
  that aliases the host memory (JAX holds the numpy array while it does). The
  check is the arrays' reference counts, at each `next()`; a buffer still held
  stays untouched and a fresh one is allocated instead.
- The arrays handed out are read-only, so that what the pool knows a buffer holds
  stays true while it is out: a batch to change is copied first
  (`{k: np.array(v) for k, v in batch.items()}`). Setting `writeable` back on an
  array handed out, or holding a batch only through a weak reference or a raw
  address, breaks the contract.
- A buffer whose writing failed part-way (an error, a Ctrl-C) is dropped, not reused.

With worker processes, a buffer's pixel arrays live in a slot of a shared arena
(`workers/arena.py`: the workers copy their samples' pixels into them) while a slot is
free, else in this process's memory; the contract is the same for both.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from typing import Any, Callable

import numpy as np

from bagel_grain.packed_row import PackedRow
from bagel_grain.packing.row import EMPTY, PIXELS, Capacities, Extent, empty_row

# The pool keeps the buffers of the last few batches: one the caller still holds while
# it asks for the next, one or two in a prefetch queue, and the one being written.
KEEP = 3
# An array only a buffer's dict references, counted as `released` counts: its baseline.
# Measured, not assumed (the dict, the loop's name, getrefcount's argument: 3 on CPython
# 3.11), as interpreters differ in the references they take (3.14 borrows some, and
# counts fewer): a held buffer must never look released.
_PROBE = {"probe": np.empty(0)}


def _most_refs(arrays) -> int:
  """The largest reference count among `arrays`' values, as seen from this loop."""
  most = 0
  for array in arrays.values():
    most = max(most, sys.getrefcount(array))
  return most


@dataclasses.dataclass(eq=False)
class BatchBuffer:
  """One batch's arrays, and per row what its last write touched."""

  arrays: PackedRow
  extents: list[Extent]
  slot: int | None = None  # its slot of the pool's arena (its pixel arrays), if any

  def released(self) -> bool:
    """Whether nothing outside the pool references any of the arrays (or a view of one)."""
    return _most_refs(self.arrays) <= _most_refs(_PROBE)

  @property
  def nbytes(self) -> int:
    return sum(array.nbytes for array in self.arrays.values())


class BatchBuffers:
  """A pool of up to `keep` batch buffers of `batch_size` rows with `capacities`.

  `take()` gives a writable buffer (a released one, else a fresh one); `hand_out()`
  makes its arrays read-only, keeps it in the pool and gives the batch's dict.
  """

  def __init__(self, capacities: Capacities, batch_size: int, keep: int = KEEP):
    self._capacities, self._batch_size = capacities, batch_size
    self._pool: collections.deque[BatchBuffer] = collections.deque(maxlen=keep)
    self.reused = self.allocated = 0
    self.arena: Any = None  # see share()
    self._shared = False

  def share(self, make_arena: Callable[[dict, int], Any]):
    """From now on, fresh buffers' pixel arrays go in slots of a shared arena while one is
    free: `make_arena(specs, slots)` (from whoever runs the processes that share it, e.g.
    `workers.Fetcher.make_arena`) makes it for the pixel arrays' `{name: (shape, dtype)}`,
    with the pool's size and two the caller may hold as slots; it has `take()`, giving
    `(slot, pixel arrays)` or None. Returns the arena, or None where shared memory cannot
    be had (asked once)."""
    if not self._shared:
      self._shared = True
      shapes = empty_row(self._capacities, (self._batch_size,))
      self.arena = make_arena({name: (shapes[name].shape, shapes[name].dtype)
                               for name in PIXELS}, (self._pool.maxlen or KEEP) + 2)
    return self.arena

  def take(self) -> BatchBuffer:
    """A buffer to write the next batch into, out of the pool until handed out."""
    for buffer in self._pool:
      if buffer.released():
        self._pool.remove(buffer)
        for array in buffer.arrays.values():
          array.flags.writeable = True  # its own memory: only the pool had made it read-only
        self.reused += 1
        return buffer
    self.allocated += 1
    arrays = empty_row(self._capacities, (self._batch_size,))
    taken = self.arena.take() if self.arena is not None else None
    if taken is None:
      return BatchBuffer(arrays, [EMPTY] * self._batch_size)
    slot, pixels = taken
    arrays.update(pixels)
    return BatchBuffer(arrays, [EMPTY] * self._batch_size, slot)

  def hand_out(self, buffer: BatchBuffer) -> dict:
    """The batch's dict of read-only arrays; the buffer joins the pool (evicting the oldest,
    which is then the caller's alone)."""
    for array in buffer.arrays.values():
      array.flags.writeable = False
    self._pool.append(buffer)
    return dict(buffer.arrays)

  def close(self) -> None:
    """Lets go of the pool and the arena (the batches the caller holds keep their memory)."""
    self._pool.clear()
    self.arena = None

  def stats(self) -> dict[str, int]:
    """Buffers pooled and their bytes, how many are held outside; batches written into a
    reused buffer and into a fresh one."""
    held = sum(not b.released() for b in self._pool)
    return {"pooled": len(self._pool), "pooled_bytes": sum(b.nbytes for b in self._pool),
            "held": held, "reused": self.reused, "allocated": self.allocated}
