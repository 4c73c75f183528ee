"""Datasets for tests/test_workers_*.py: elements that never finish in worker processes, or
say what a worker imported.

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


class FailsWhileDown:
  """Element i is i, unless the file `down` exists: then reading it is storage that keeps
  failing (StorageUnavailableError), in whichever process computes it."""

  def __init__(self, size: int, down: str):
    self.size, self.down = size, down

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> int:
    from bagel_grain.errors import StorageUnavailableError  # pylint: disable=import-outside-toplevel
    if os.path.exists(self.down):
      raise StorageUnavailableError(f"element {index}", "OSError: connection refused", 1.0, 3)
    return index


class ModulesLoaded:
  """Element i: the computing process's pid, then which of `names` it has imported (1 or 0
  each); with `import_first`, it imports that module first."""

  def __init__(self, names: tuple[str, ...], import_first: str | None = None):
    self.names, self.import_first = names, import_first

  def __len__(self) -> int:
    return 10_000

  def __getitem__(self, index: int) -> list[int]:
    if self.import_first:
      __import__(self.import_first)
    import sys  # pylint: disable=import-outside-toplevel
    return [os.getpid()] + [int(name in sys.modules) for name in self.names]


class LoadsOnlyWhenAllowed:
  """Element i is i; a worker process that unpickles it waits until the file `allowed`
  exists (a worker that stays loading: the main process computes every element itself)."""

  def __init__(self, size: int, allowed: str):
    self.size, self.allowed = size, allowed

  def __setstate__(self, state):
    self.__dict__.update(state)
    while not os.path.exists(self.allowed):
      time.sleep(0.05)

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> int:
    return index
