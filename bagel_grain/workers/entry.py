"""Where a spawned worker process starts: our code is loaded without JAX.

A worker never runs JAX, but Grain imports it on its own import, for its profiler
(`grain._src.core.profiler`, which falls back to a no-op when the import fails):
about 150 MiB of each worker's resident memory, half of it the pages of jaxlib's
library. This module imports nothing of ours or of Grain's; `worker_main` loads the
worker's code with `import jax` failing, then lets it be imported again, so a user's
dataset that needs JAX in a worker still gets it (and pays for it).
"""

from __future__ import annotations

import contextlib
import logging
import sys

_BLOCKED = ("jax", "jaxlib")


@contextlib.contextmanager
def jax_unavailable():
  """`import jax` raises ImportError inside (where nothing imported it yet); Grain's
  warning that its profiler is off is not printed."""
  blocked = [name for name in _BLOCKED if name not in sys.modules]
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)
  for name in blocked:
    sys.modules[name] = None  # the import system's own "not importable" mark
  try:
    yield
  finally:
    for name in blocked:
      if sys.modules.get(name, 0) is None:
        del sys.modules[name]
    absl.setLevel(level)


def worker_main(conn) -> None:
  """A worker process's target: loads the worker's code without JAX, then runs it."""
  with jax_unavailable():
    from bagel_grain.workers import process  # pylint: disable=import-outside-toplevel
  process._worker_main(conn)  # pylint: disable=protected-access
