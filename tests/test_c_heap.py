"""c_heap: what glibc keeps after threads free it is handed back, and workers use few arenas."""

import subprocess
import sys
import textwrap

import pytest

from bagel_grain import c_heap

glibc = pytest.mark.skipif(c_heap._LIBC is None, reason="glibc's malloc only")  # pylint: disable=protected-access

_CHURN = textwrap.dedent("""
    import sys, threading
    from bagel_grain import c_heap
    def anon_mib():
      return int(open('/proc/self/status').read().split('RssAnon:')[1].split()[0]) // 1024
    limit = int(sys.argv[1])
    if limit:
      assert c_heap.limit_arenas(limit)
    keep, start = [], threading.Barrier(8)
    def churn():  # 40 MB of small blocks in this thread's arena, a few kept so it cannot shrink
      start.wait()
      blocks = [bytearray(b'x' * 20000) for _ in range(2000)]
      keep.extend(blocks[::50])
    base = anon_mib()
    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    grown = anon_mib() - base
    c_heap.trim()
    print(grown, anon_mib() - base)
    import ctypes; ctypes.CDLL(None).malloc_stats()  # one 'Arena N:' block per arena, to stderr
""")


def _churn(limit: int) -> tuple[int, int, int]:
  done = subprocess.run([sys.executable, "-c", _CHURN, str(limit)], capture_output=True,
                        text=True, timeout=120, check=True)
  grown, after = map(int, done.stdout.split())
  return grown, after, done.stderr.count("Arena ")


@glibc
def test_trim_hands_back_what_threads_freed_but_their_arenas_kept():
  grown, after, _ = _churn(0)
  assert grown > 150  # 8 threads x 40 MB freed, kept by their arenas
  assert after < grown / 4


@glibc
def test_a_worker_s_limit_keeps_eight_threads_to_its_arenas():
  assert _churn(0)[2] > c_heap.WORKER_ARENAS  # each thread its own arena, unlimited
  assert _churn(c_heap.WORKER_ARENAS)[2] <= c_heap.WORKER_ARENAS


def test_the_trimmer_trims_at_most_once_a_period(monkeypatch):
  now, calls = [100.0], []
  monkeypatch.setattr(c_heap.time, "monotonic", lambda: now[0])
  monkeypatch.setattr(c_heap, "trim", lambda: calls.append(now[0]) or True)
  trimmer = c_heap.Trimmer(every_s=10.0)
  for step in range(40):  # asked every second for 40 s
    now[0] = 100.0 + step
    trimmer.maybe_trim()
  assert calls == [110.0, 120.0, 130.0]
