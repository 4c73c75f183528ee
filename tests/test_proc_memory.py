"""The soak's memory reading (tools/proc_memory.py): shared pages apart from a leak."""

import json
import mmap
import os
import subprocess
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


def test_anonymous_pages_are_split_by_the_layout_of_their_mappings():
  arena, stack = 64 * MIB, 8 * MIB
  maps = [  # (start, end, perms, path, anonymous bytes), in address order
      (0x400000, 0x500000, "rw-p", "/usr/bin/python3", 1 * MIB),  # a library's data, written
      (0x600000, 0x2600000, "rw-p", "[heap]", 30 * MIB),
      (3 * arena, 3 * arena + 20 * MIB, "rw-p", "", 18 * MIB),  # a thread arena's used part
      (3 * arena + 20 * MIB, 4 * arena, "---p", "", 0),  # ... and the rest of its reservation
      (5 * arena + 4096, 5 * arena + 8192, "---p", "", 0),  # a thread's guard page
      (5 * arena + 8192, 5 * arena + 8192 + stack, "rw-p", "", 2 * MIB),  # ... its stack
      (5 * arena + 9 * MIB, 5 * arena + 40 * MIB, "rw-p", "", 25 * MIB),  # mmaps, merged
      (7 * arena, 7 * arena + 4 * MIB, "rw-p", "", 4 * MIB),  # aligned, not reserved: an mmap
      (8 * arena, 8 * arena + 1 * MIB, "rw-p", "[stack]", 1 * MIB),
      (3 << 40, (3 << 40) + 64 * MIB, "rw-p", "", 5 * MIB),  # at mimalloc's hinted addresses
  ]
  assert proc_memory.split_mappings(maps) == {
      "heap": 30, "thread_arenas": 18, "stacks": 3, "mimalloc": 5, "other_anon": 29,
      "file_private": 1}


_SPLIT = """
import json, mmap, os, sys, threading
sys.path.insert(0, sys.argv[1])
import proc_memory
MIB = 1 << 20
kept = []
def allocate():  # blocks over pymalloc's 512 bytes, under mmap's threshold: the arena
  kept.append([bytearray(2000) for _ in range(16_000)])  # 32 MiB
before = proc_memory.anon_split_mib(os.getpid())
thread = threading.Thread(target=allocate)
thread.start()
thread.join()
with mmap.mmap(-1, 24 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
  for i in range(0, 24 * MIB, mmap.PAGESIZE):
    m[i] = 1
  after = proc_memory.anon_split_mib(os.getpid())
  anon = proc_memory.status_mib(os.getpid())["RssAnon"]
print(json.dumps([before, after, anon]))
"""


def test_the_split_of_a_process_finds_a_thread_arena_and_an_mmap_and_adds_up():
  done = subprocess.run([sys.executable, "-c", _SPLIT, str(Path(proc_memory.__file__).parent)],
                        capture_output=True, text=True, timeout=120, check=True)
  before, after, anon = json.loads(done.stdout)  # a fresh process: its first thread arena
  assert after["thread_arenas"] - before["thread_arenas"] >= 30
  assert after["other_anon"] - before["other_anon"] >= 23
  assert abs(sum(after.values()) - anon) < 4  # every anonymous page in one part


def test_pymalloc_arenas_are_counted():
  before = proc_memory.pymalloc_arenas()
  # 16 B each: more than every arena held could take in, so at least 4 MiB of new ones
  small = [object() for _ in range((before + 4) << 16)]
  assert proc_memory.pymalloc_arenas() - before >= 4
  del small


_MALLOC_INFO = """<malloc version="1">
<heap nr="0">
<sizes>
  <size from="33" to="48" total="96" count="2"/>
  <size from="131073" to="262144" total="%d" count="1"/>
  <unsorted from="1025" to="4096" total="4096" count="1"/>
</sizes>
<total type="fast" count="2" size="96"/>
<total type="rest" count="3" size="%d"/>
<system type="current" size="%d"/>
<system type="max" size="%d"/>
</heap>
<total type="fast" count="2" size="96"/>
</malloc>""" % (200 << 10, (200 << 10) + 4096 + (3 << 20), 8 << 20, 9 << 20)


def test_an_arena_s_top_is_what_is_free_in_it_outside_its_bins():
  # malloc_info counts the top chunk in "rest" without listing it: it is what is left.
  (arena,) = proc_memory.malloc_arenas(_MALLOC_INFO)
  assert arena["nr"] == 0 and arena["system"] == 8.0 and arena["system_max"] == 9.0
  assert arena["top"] == 3.0
  assert arena["free_large"] == 0.2 and arena["free_chunks"] == 3
  assert arena["free"] == round(((200 << 10) + 4096 + (3 << 20) + 96) / MIB, 1)


@pytest.mark.skipif(proc_memory.malloc_info_xml() is None, reason="glibc's malloc only")
def test_this_process_s_arenas_are_read_from_malloc_info():
  arenas = proc_memory.malloc_arenas()
  assert arenas and arenas[0]["nr"] == 0 and arenas[0]["system"] > 0



_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import proc_memory
print(proc_memory.mmap_threshold_probe())
"""


@pytest.mark.skipif(proc_memory.malloc_info_xml() is None, reason="glibc's malloc only")
def test_the_mmap_threshold_probe_finds_a_size_glibc_maps():
  # In a fresh interpreter: a test process's threshold is wherever its tests left it
  # (up to where none of the probe's sizes is mmapped). glibc's starts at 128 KiB.
  done = subprocess.run([sys.executable, "-c", _PROBE, str(Path(proc_memory.__file__).parent)],
                        capture_output=True, text=True, timeout=60, check=True)
  assert int(done.stdout) >= 128 << 10
