"""The soak's memory reading (tools/proc_memory.py): shared pages apart from a leak."""

import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import proc_memory  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists()
                                or not hasattr(os, "memfd_create"), reason="Linux /proc")
MIB = 1 << 20


def test_touched_shared_pages_count_as_shmem_within_their_mapping():
  before = proc_memory.status_mib(os.getpid())
  mapped_before = proc_memory.shared_mapped_mib(os.getpid())
  fd = os.memfd_create("soak-test")
  try:
    os.ftruncate(fd, 32 * MIB)
    with mmap.mmap(fd, 32 * MIB) as m:
      for i in range(0, 24 * MIB, mmap.PAGESIZE):
        m[i] = 1
      after = proc_memory.status_mib(os.getpid())
      mapped = proc_memory.shared_mapped_mib(os.getpid())
  finally:
    os.close(fd)
  assert after["RssShmem"] - before["RssShmem"] >= 23
  assert after["RssAnon"] - before["RssAnon"] < 8  # not anonymous: no leak is seen
  assert mapped - mapped_before == 32  # the bound: the whole mapping, touched or not


def test_reset_peak_restarts_the_high_water_mark():
  block = bytearray(64 * MIB)
  for i in range(0, len(block), mmap.PAGESIZE):
    block[i] = 1
  del block  # a large block goes back to the kernel at once
  assert proc_memory.status_mib(os.getpid())["VmHWM"] - \
      proc_memory.status_mib(os.getpid())["VmRSS"] >= 60
  assert proc_memory.reset_peak(os.getpid())
  now = proc_memory.status_mib(os.getpid())
  assert now["VmHWM"] - now["VmRSS"] < 8


def _series(anon, shmem):
  """Two samples a half: (t, status) with the given RssAnon and RssShmem per sample."""
  return [(t, {"VmRSS": a + s + 100, "RssAnon": a, "RssFile": 100, "RssShmem": s,
               "Threads": 9})
          for t, a, s in zip((0, 1, 2, 3), anon, shmem)]


def test_the_verdict_judges_anonymous_and_shared_growth_apart():
  watch = proc_memory.Watch(dict, half=2)
  watch.series = {"main": _series([300, 300, 301, 302], [0, 10, 120, 200]),
                  "worker 1": _series([200, 200, 200, 200], [0, 0, 5, 5])}
  watch.shared = {"main": 256.0, "worker 1": 128.0}
  verdict = watch.summary(anon_tolerance_mib=16)
  assert verdict["flat"], verdict["reasons"]  # 190 MiB more shmem, within 256 mapped
  assert verdict["processes"]["main"]["growth"]["RssShmem_peak"] == 190
  assert verdict["processes"]["main"]["growth"]["RssAnon_peak"] == 2

  watch.series["worker 1"] = _series([200, 200, 200, 240], [0, 0, 5, 5])  # a leak
  watch.shared["main"] = 128.0  # and more shared pages than mapped: not shared memory
  verdict = watch.summary(anon_tolerance_mib=16)
  assert not verdict["flat"]
  assert any(r.startswith("worker 1: RssAnon_peak grew 40") for r in verdict["reasons"])
  assert any(r.startswith("main: RssShmem 200") for r in verdict["reasons"])
