"""Elements computed ahead of need in worker processes (or inline): the process pool the
mixing stage reads its groups through.

The names below load on first use: a worker process starts from `workers.entry`, which
must be importable without Grain (see there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bagel_grain.lazy_names import lazy_getattr

if TYPE_CHECKING:
  from bagel_grain.workers.fetcher import Fetcher
  from bagel_grain.workers.process import WORKER_NICENESS, WorkerError

_HOMES = {"Fetcher": "bagel_grain.workers.fetcher",
          "WORKER_NICENESS": "bagel_grain.workers.process",
          "WorkerError": "bagel_grain.workers.process"}
__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES, globals())
