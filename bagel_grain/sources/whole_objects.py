"""Small objects in a bucket that a build reads whole, and the one budget that bounds them.

A small JSONL object, or every file of a small parquet dataset, is read whole at build
(one pinned request each) and served from those bytes: on a bucket the first batch then
waits on no request after the build. "Small" is per object, `OBJECT_BYTES`; and what one
process holds so, of every family and every build, is at most `BUDGET`, reserved before
any byte is read. Held bytes live as long as the process (a worker gets them with its
pickled sources).
"""

from __future__ import annotations

import threading
from typing import Hashable

OBJECT_BYTES = 1 << 20
BUDGET = 16 << 20


class _Held:
  """Objects held whole, by key (a content's identity); `reserve` counts their bytes."""

  def __init__(self):
    self._objects: dict[Hashable, bytes] = {}
    self._reserved: set[Hashable] = set()  # held, or to be: the same content built again
    self._bytes = 0  # ... reserves nothing more
    self._lock = threading.Lock()

  def reserve(self, sizes: dict[Hashable, int]) -> bool:
    """Whether this process may hold these objects (key: bytes) beside what it holds or
    reserved; if so they are reserved, all or none."""
    with self._lock:
      new = {key: int(n) for key, n in sizes.items() if key not in self._reserved}
      if self._bytes + sum(new.values()) > BUDGET:
        return False
      self._reserved.update(new)
      self._bytes += sum(new.values())
      return True

  def reserved(self, key: Hashable) -> bool:
    with self._lock:
      return key in self._reserved

  def put(self, key: Hashable, data: bytes) -> None:
    with self._lock:
      self._objects.setdefault(key, data)

  def get(self, key: Hashable) -> bytes | None:
    with self._lock:
      return self._objects.get(key)


HELD = _Held()
