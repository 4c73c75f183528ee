"""The fetcher: elements by (group, index), the same from worker processes as inline.

Runs its worker processes under a deadline (signal.alarm): a hang fails the test.
"""

import numpy as np
import psutil
import pytest

from bagel_grain.packing.fetch import Fetcher, WorkerError
from deadline import deadline


class Squares:
  """A group whose element i is [i*i] * 3, or an error at `bad`."""

  def __init__(self, size, bad=None):
    self.size, self.bad = size, bad

  def __len__(self):
    return self.size

  def __getitem__(self, index):
    if index == self.bad:
      raise ValueError(f"element {index} is bad")
    return np.full(3, index * index)


def workers_alive():
  return [p for p in psutil.Process().children(recursive=True)
          if "resource_tracker" not in " ".join(p.cmdline()) and p.status() != "zombie"]


def test_inline_fetcher_computes_what_it_is_asked_for():
  fetcher = Fetcher([Squares(5), Squares(4)], workers=0, depths=[0, 0])
  assert fetcher.get(1, 3).tolist() == [9, 9, 9]
  assert [a.tolist() for a in fetcher.get_many([(0, 2), (1, 1)])] == [[4] * 3, [1] * 3]
  fetcher.close()
  fetcher.close()


def test_workers_give_the_same_elements_in_any_order_then_fail_clearly_and_leave():
  groups = [Squares(40), Squares(30, bad=25)]
  order = [(1, 0), (0, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (0, 3)]
  with deadline(120):
    fetcher = Fetcher(groups, workers=2, depths=[4, 4])
    try:
      got = [fetcher.get(g, i) for g, i in order]
      assert [a.tolist() for a in got] == [groups[g][i].tolist() for g, i in order]
      many = fetcher.get_many([(0, 30), (1, 20), (0, 31)])
      assert [a[0] for a in many] == [900, 400, 961]
      fetcher.reset()  # forgets what it computed ahead; still answers
      assert fetcher.get(0, 5)[0] == 25
      # A failing element is raised, from a worker or from the main process when the
      # element was not handed out yet: never a hang, never a skipped element.
      with pytest.raises((WorkerError, ValueError), match="element 25"):
        for i in range(4, 30):
          assert fetcher.get(1, i)[0] == i * i
    finally:
      fetcher.close()
      fetcher.close()
    assert not psutil.wait_procs(workers_alive(), timeout=5)[1]
