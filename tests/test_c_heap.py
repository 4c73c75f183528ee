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



_TOP = textwrap.dedent("""
    import ctypes, sys, threading
    from bagel_grain import c_heap
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    class MallInfo2(ctypes.Structure):
      _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                  "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2
    libc.free(libc.malloc(20 << 20))  # an mmapped block freed: glibc raises its thresholds
    if sys.argv[1] == "trimmed":
      assert c_heap.keep_thread_tops_trimmed()
    before = libc.mallinfo2().arena
    def images():  # image-sized blocks in a thread's arena, written, then freed
      blocks = [libc.malloc(3 << 20) for _ in range(8)]
      for b in blocks:
        ctypes.memset(b, 1, 3 << 20)
      for b in blocks:
        libc.free(b)
    thread = threading.Thread(target=images)
    thread.start()
    thread.join()
    libc.malloc_trim(0)  # what the fetcher does now and then: not the thread arena's top
    print((libc.mallinfo2().arena - before) >> 20)  # MiB the arenas still hold from the system
""")


def _kept_mib(how: str) -> int:
  done = subprocess.run([sys.executable, "-c", _TOP, how], capture_output=True, text=True,
                        timeout=120, check=True)
  return int(done.stdout)


@pytest.mark.skipif(c_heap._LIBC is None or not hasattr(c_heap._LIBC, "mallinfo2"),  # pylint: disable=protected-access
                    reason="glibc 2.33's malloc only")
def test_with_tops_trimmed_a_thread_arena_gives_back_the_image_sized_blocks_it_freed():
  # The soak's main process: glibc's thresholds rise after one large block is freed, and
  # from then on each thread arena kept the top it reached, malloc_trim or not.
  assert _kept_mib("glibc") >= 20
  assert _kept_mib("trimmed") <= 2


_ROUNDS = textwrap.dedent("""
    import resource, sys, threading
    import numpy as np
    from bagel_grain import c_heap
    assert c_heap.limit_arenas()
    if sys.argv[1] == "reuse":
      assert c_heap.reuse_freed_blocks()
    faults = []
    def element_after_element():  # an element's images and arrays, made and freed, 30 times
      for i in range(30):
        if i == 10:
          faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
        held = [np.ones(size << 20, np.uint8) for size in (8, 3, 12, 2, 6)]
        del held
      faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
    thread = threading.Thread(target=element_after_element)
    thread.start()
    thread.join()
    print(faults[1] - faults[0])
""")


def _faults(mode: str) -> int:
  done = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True,
                        timeout=120, check=True)
  return int(done.stdout.split()[-1])


@pytest.mark.skipif(c_heap._LIBC is None, reason="glibc's malloc only")  # pylint: disable=protected-access
def test_a_worker_s_thread_uses_the_pages_of_the_last_element_again():
  # 20 rounds of 31 MiB: glibc's own thresholds give every round fresh pages (about 56,000
  # faults here); a worker's keep them
  reused = _faults("reuse")
  assert reused * 10 < _faults("default")
  assert reused < 20 * (31 << 20) // 4096 // 10  # under a tenth of a page fault per page
