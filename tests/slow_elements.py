"""A dataset whose elements never finish in worker processes (for tests/test_workers_fetcher.py).

A module of its own, not a test module: spawned workers import it by name.
"""

import os
import time


class StallsInWorkers:
  """Element i is i; in any process but the one that made it, it never arrives."""

  def __init__(self, size: int, parent_delay_s: float = 0.0):
    self.size = size
    self.parent = os.getpid()
    self.parent_delay_s = parent_delay_s

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> int:
    if os.getpid() != self.parent:
      time.sleep(3600)  # a read that stalls
    time.sleep(self.parent_delay_s)
    return index
