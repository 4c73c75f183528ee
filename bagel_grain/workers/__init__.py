"""Elements computed ahead of need in worker processes (or inline): the process pool the
mixing stage reads its groups through."""

from bagel_grain.workers.fetcher import Fetcher
from bagel_grain.workers.process import WORKER_NICENESS, WorkerError

__all__ = ["Fetcher", "WORKER_NICENESS", "WorkerError"]
