"""c_heap: a worker's threads share few malloc arenas."""

import subprocess
import sys
import textwrap

import pytest

from bagel_grain import c_heap

_THREADS = textwrap.dedent("""
    import ctypes, sys, threading
    from bagel_grain import c_heap
    limit = int(sys.argv[1])
    if limit:
      assert c_heap.limit_arenas(limit)
    keep, start = [], threading.Barrier(8)
    def churn():  # 8 threads allocating at once: each may get an arena of its own
      start.wait()
      keep.extend(bytearray(20000) for _ in range(200))
    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    ctypes.CDLL(None).malloc_stats()  # one 'Arena N:' block per arena, to stderr
""")


def _arenas(limit: int) -> int:
  done = subprocess.run([sys.executable, "-c", _THREADS, str(limit)], capture_output=True,
                        text=True, timeout=120, check=True)
  return done.stderr.count("Arena ")


@pytest.mark.skipif(c_heap._LIBC is None, reason="glibc's malloc only")  # pylint: disable=protected-access
def test_a_worker_s_limit_keeps_eight_threads_to_its_arenas():
  assert _arenas(0) > c_heap.WORKER_ARENAS  # unlimited: the threads spread over more arenas
  assert _arenas(c_heap.WORKER_ARENAS) <= c_heap.WORKER_ARENAS

