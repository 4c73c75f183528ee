"""A worker process loads its code without JAX (about 150 MiB of resident memory each)."""

import os
import sys
import time

from bagel_grain.workers import Fetcher
from deadline import deadline
from slow_elements import ModulesLoaded


def _in_a_worker(group) -> list[int]:
  """What the first element a worker computed says (the main process computes the first
  ones itself while the worker starts)."""
  with deadline(120):
    fetcher = Fetcher([group], workers=1, depths=[2])
    try:
      for index in range(len(group)):
        pid, *flags = fetcher.get(0, index)
        if pid != os.getpid():
          return flags
        time.sleep(0.05)  # gives the worker time to start
    finally:
      fetcher.close()
  raise AssertionError("no element came from the worker")


def test_a_worker_loads_grain_and_our_code_without_jax():
  assert "jax" in sys.modules  # here (Grain imports it): the worker's is another story
  names = ("grain", "bagel_grain.workers.process", "jax", "jaxlib")
  assert _in_a_worker(ModulesLoaded(names)) == [1, 1, 0, 0]


def test_a_dataset_that_imports_jax_in_a_worker_gets_it():
  assert _in_a_worker(ModulesLoaded(("jax",), import_first="jax")) == [1]
