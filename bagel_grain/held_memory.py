"""What a process holds for its pipelines, by kind: the figures of the bench's memory split.

The holders (each group's read-ahead, each parquet row-group cache) register here
when they are made, or made again from a pickle in a worker; `snapshot()` adds up
what the live ones hold now, with the process's RSS. A worker sends its snapshot
with each element (`workers.process`; taken at most once a second), so the main process
knows its workers' figures as of about their last element.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

import psutil

READ_AHEAD = "read_ahead_bytes"  # read (records, files) but not yet taken, or in flight
ROW_GROUP_CACHE = "row_group_cache_bytes"  # decoded parquet row groups kept
KINDS = (READ_AHEAD, ROW_GROUP_CACHE)

_holders: weakref.WeakKeyDictionary[Any, tuple[str, Callable[[Any], int]]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()
_process: psutil.Process | None = None


def register(holder: Any, kind: str, measure: Callable[[Any], int]) -> None:
  """Counts `measure(holder)` under `kind` for as long as `holder` lives."""
  with _lock:
    _holders[holder] = (kind, measure)


def snapshot() -> dict[str, int]:
  """Bytes held now by kind (every live holder of this process, of every pipeline), and
  "rss_bytes": the process's resident memory."""
  global _process  # pylint: disable=global-statement
  with _lock:
    holders = list(_holders.items())
  out = dict.fromkeys(KINDS, 0)
  for holder, (kind, measure) in holders:
    out[kind] += measure(holder)
  if _process is None or _process.pid != os.getpid():  # a forked child: its own
    _process = psutil.Process()
  out["rss_bytes"] = _process.memory_info().rss
  return out
