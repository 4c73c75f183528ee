"""Elements of the groups' MapDatasets by index, computed ahead by worker processes.

Each group is consumed in index order, so the fetcher keeps a window of the next
indices of every group in flight. Results are addressed by (group, index), never
by arrival order: the packed stream is the same for any number of workers. When
the element the packer needs has not been picked up by a worker yet (workers
still starting, or all busy), the main process computes it itself instead of
waiting: the first batch does not wait for worker start-up.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Sequence

from bagel_grain.errors import BagelGrainError

_worker_datasets: Sequence[Any] = ()  # set once per worker process by _init_worker


class WorkerError(BagelGrainError):
  """A worker process died or failed: the stream cannot continue."""


def _init_worker(datasets: Sequence[Any]) -> None:
  global _worker_datasets
  _worker_datasets = datasets


def _compute(group: int, index: int) -> Any:
  return _worker_datasets[group][index]


class Fetcher:
  """`get(group, index)`: the element, from a pool of `workers` processes or inline (0)."""

  def __init__(self, datasets: Sequence[Any], *, workers: int, depths: Sequence[int]):
    self._datasets = list(datasets)
    self._depths = list(depths)
    self._futures: dict[tuple[int, int], concurrent.futures.Future] = {}
    self._pool = None
    if workers > 0:
      self._pool = concurrent.futures.ProcessPoolExecutor(
          workers, mp_context=multiprocessing.get_context("spawn"),
          initializer=_init_worker, initargs=(self._datasets,))

  def _submit(self, group: int, index: int) -> None:
    key = (group, index)
    if key not in self._futures and index < len(self._datasets[group]):
      try:
        self._futures[key] = self._pool.submit(_compute, group, index)
      except BrokenProcessPool as e:
        self.close()
        raise WorkerError(f"the worker pool broke (a worker process died): {e}") from None

  def get(self, group: int, index: int) -> Any:
    if self._pool is None:
      return self._datasets[group][index]
    self._submit(group, index)
    for ahead in range(1, self._depths[group] + 1):
      self._submit(group, index + ahead)
    return self._result(group, index)

  def get_many(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
    """Several elements at once (a restore's buffer), computed in parallel."""
    if self._pool is None:
      return [self._datasets[g][i] for g, i in keys]
    for g, i in keys:
      self._submit(g, i)
    return [self._result(g, i) for g, i in keys]

  def _result(self, group: int, index: int) -> Any:
    future = self._futures.pop((group, index))
    if future.cancel():  # no worker has taken it yet: do it here
      return self._datasets[group][index]
    try:
      return future.result()
    except BrokenProcessPool as e:
      self.close()
      raise WorkerError(f"a worker process died while decoding group {group} element "
                        f"{index}: {e}") from None

  def reset(self) -> None:
    for future in self._futures.values():
      future.cancel()
    self._futures.clear()

  def close(self) -> None:
    if self._pool is not None:
      self.reset()
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None
