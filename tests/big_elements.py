"""A dataset of large arrays (for tests/test_workers_slab.py).

A module of its own, not a test module: spawned workers import it by name.
"""

import os
import time

import numpy as np


class Pixels:
  """Element i: {"pixels": `nbytes` uint8 of value i % 251, "index": int32 [i]}; computed in
  the process that made it, it takes `slow_here_s` (so that workers compute most)."""

  def __init__(self, size: int, nbytes: int, slow_here_s: float = 0.0):
    self.size, self.nbytes = size, nbytes
    self.maker, self.slow_here_s = os.getpid(), slow_here_s

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    if os.getpid() == self.maker:
      time.sleep(self.slow_here_s)
    return {"pixels": np.full(self.nbytes, index % 251, np.uint8),
            "index": np.array([index], np.int32)}


class Unpicklable:
  """Element i: a lambda, which a worker computes but cannot send; computed in the process
  that made it, it takes 0.2 s (so that a worker computes one)."""

  def __init__(self):
    self.maker = os.getpid()

  def __len__(self) -> int:
    return 40

  def __getitem__(self, index: int):
    if os.getpid() == self.maker:
      time.sleep(0.2)
    return lambda: index
