"""Elements computed ahead of need in worker processes (or inline): the process pool the
mixing stage reads its groups through.

The names below load on first use: a worker process starts from `workers.entry`, which
must be importable without Grain (see there).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from bagel_grain.workers.fetcher import Fetcher
  from bagel_grain.workers.process import WORKER_NICENESS, WorkerError

_HOMES = {"Fetcher": "bagel_grain.workers.fetcher",
          "WORKER_NICENESS": "bagel_grain.workers.process",
          "WorkerError": "bagel_grain.workers.process"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
  if name not in _HOMES:
    raise AttributeError(f"module 'bagel_grain.workers' has no attribute {name!r}")
  value = getattr(importlib.import_module(_HOMES[name]), name)
  globals()[name] = value
  return value
