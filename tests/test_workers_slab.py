"""Workers' arrays cross through shared-memory slabs: views, regions given back, fallback to
the socket, and nothing left behind when the pipeline closes or a process is killed."""

import gc
import json
import mmap
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from big_elements import Pixels
from deadline import deadline
from bagel_grain.workers import Fetcher, WorkerError
from bagel_grain.workers import arena
from bagel_grain.workers import slab as slabs

SLAB_NAME = "memfd:bagel-grain-slab"
TESTS = Path(__file__).parent


def owner(array) -> object:
  """What finally holds an array's memory: an mmap (a slab), bytes (the socket), ..."""
  held = array
  while isinstance(held, (np.ndarray, memoryview)):
    held = held.base if isinstance(held, np.ndarray) else held.obj
  return held


def slabs_held(pid: int | str = "self", name: str = SLAB_NAME) -> int:
  """Mappings and descriptors of slabs in a process (an mmap keeps a descriptor of its own)."""
  maps = Path(f"/proc/{pid}/maps").read_text().count(name)
  fds = 0
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      fds += name in os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
      pass
  return maps + fds


def arenas_held(pid: int | str = "self") -> int:
  """Mappings and descriptors of batch arenas (`workers/arena.py`) in a process."""
  return slabs_held(pid, "memfd:" + arena.NAME)


def started(fetcher: Fetcher) -> Fetcher:
  """`fetcher` once all its workers have loaded their datasets (else the main process
  computes the first elements itself)."""
  while not all("at_ready" in w for w in fetcher.worker_memory()):
    time.sleep(0.05)
  return fetcher


def shm_entries() -> set[str]:
  return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_regions_are_first_fit_and_merge_when_freed():
  regions = slabs.Regions(1024)
  a, b, c = regions.take(100), regions.take(200), regions.take(300)
  assert (a, b, c) == (0, 128, 384)  # rounded up to 64 bytes each
  assert regions.take(400) is None  # 704 taken of 1024
  regions.free(b)
  assert regions.take(330) is None  # 256 and 320 free, apart
  regions.free(a)
  assert regions.take(330) == 0  # a and b merged
  regions.free(c)
  regions.free(0)
  assert regions.take(1024) == 0 and regions.taken_bytes == 1024


def test_an_element_placed_in_a_slab_is_read_only_views_whose_region_returns_when_dropped(slab_pair):
  worker, main = slab_pair
  value = {"image": np.arange(3 * 5 * 7, dtype=np.uint8).reshape(3, 5, 7),
           "ids": np.arange(9, dtype=np.int32), "text": "a caption"}
  buffers = []
  payload = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
  placed = worker.place(buffers)
  assert placed is not None and placed[0] == 0
  got = pickle.loads(payload, buffers=main.buffers(placed))
  assert got["text"] == "a caption"
  for name in ("image", "ids"):
    assert np.array_equal(got[name], value[name]) and got[name].dtype == value[name].dtype
    assert not got[name].flags.writeable and isinstance(owner(got[name]), mmap.mmap)
    assert got[name].ctypes.data % 64 == 0
  view = got["image"][1:, ::2].T  # a view of a view still holds the region
  del got
  gc.collect()
  assert main.take_freed() == []
  del view
  assert main.take_freed() == [0]
  worker.free([0])
  assert worker.place(buffers) == placed  # the same region again


def slab_resident_bytes() -> int:
  """Resident bytes of this process's slab mappings (/proc/self/smaps)."""
  total, inside = 0, False
  for line in Path("/proc/self/smaps").read_text().splitlines():
    if not line[:1].isupper():  # a mapping's header line
      inside = SLAB_NAME in line
    elif inside and line.startswith("Rss:"):
      total += int(line.split()[1]) * 1024
  return total


def test_a_region_freed_beyond_the_warm_bytes_leaves_both_processes_memory():
  fd = slabs.create(8 << 20)
  if fd is None:
    pytest.skip("no memfd on this system")
  worker = slabs.WorkerSlab(os.dup(fd), 8 << 20, warm=1 << 20)
  main = slabs.MainSlab(fd, 8 << 20)
  os.close(fd)
  buffers = []
  payload = pickle.dumps(np.ones(6 << 20, np.uint8), protocol=5, buffer_callback=buffers.append)
  got = pickle.loads(payload, buffers=main.buffers(worker.place(buffers)))
  assert int(got.sum()) == 6 << 20  # read here: its pages mapped in this process
  assert slab_resident_bytes() >= 2 * (6 << 20)  # both mappings (the worker's is here too)
  del got
  worker.free(main.take_freed())
  assert slab_resident_bytes() <= 2 * (1 << 20)  # only the warm first MiB stays
  got = pickle.loads(payload, buffers=main.buffers(worker.place(buffers)))
  assert int(got.sum()) == 6 << 20  # the region written again reads right


def test_elements_from_workers_come_through_the_slab_and_its_regions_are_reused(monkeypatch):
  monkeypatch.setattr(slabs, "SLAB_BYTES", 24 << 20)
  with deadline(120):
    fetcher = started(Fetcher([Pixels(200, 1 << 20, slow_here_s=0.05)], workers=2, depths=[6]))
    try:
      ways = []
      for i in range(200):  # 200 MiB through two slabs of 24 MiB (7 elements in flight)
        got = fetcher.get(0, i)
        assert got["index"][0] == i and got["pixels"][::4096].tolist() == [i % 251] * 256
        ways.append(type(owner(got["pixels"])).__name__)
      # None by the socket: the regions went back to the workers as elements were dropped
      # (the main process computes any element no worker has picked up yet: not a copy).
      assert "bytes" not in ways and ways.count("mmap") >= 100, ways
      assert slabs_held() == 2 * 2  # the two workers' slabs, mapped here
    finally:
      fetcher.close()
    del got
    gc.collect()
    assert slabs_held() == 0


def test_an_element_with_no_room_in_the_slab_comes_over_the_socket(monkeypatch):
  monkeypatch.setattr(slabs, "SLAB_BYTES", 3 << 20)
  with deadline(120):
    fetcher = started(Fetcher([Pixels(12, 1 << 20, slow_here_s=0.5)], workers=1, depths=[2]))
    try:
      held = [fetcher.get(0, i) for i in range(12)]  # all kept: the slab fills up
    finally:
      fetcher.close()
  assert [h["index"][0] for h in held] == list(range(12))
  assert all(h["pixels"][-1] == i % 251 for i, h in enumerate(held))
  # (the main process computes what no worker has been handed yet: "NoneType")
  ways = [type(owner(h["pixels"])).__name__ for h in held]
  assert [w for w in ways if w != "NoneType"][:2] == ["mmap", "mmap"] and "bytes" in ways
  del held
  gc.collect()
  assert slabs_held() == 0


def test_without_address_space_for_a_slab_everything_comes_over_the_socket(monkeypatch):
  def no_room(fd, size):
    raise OSError(12, "Cannot allocate memory")
  monkeypatch.setattr(slabs, "MainSlab", no_room)
  with deadline(120):
    fetcher = started(Fetcher([Pixels(8, 1 << 16, slow_here_s=0.5)], workers=1, depths=[2]))
    try:
      assert slabs_held() == 0  # its descriptor closed at once
      got = [fetcher.get(0, i) for i in range(8)]
    finally:
      fetcher.close()
  assert [g["index"][0] for g in got] == list(range(8))
  assert {type(owner(g["pixels"])).__name__ for g in got} <= {"bytes", "NoneType"}
  assert "bytes" in {type(owner(g["pixels"])).__name__ for g in got}


def test_a_worker_killed_leaves_no_slab_behind_once_the_fetcher_closes():
  before = shm_entries()
  with deadline(120):
    fetcher = started(Fetcher([Pixels(100, 1 << 20)], workers=2, depths=[4]))
    try:
      got = fetcher.get(0, 0)
      victim = psutil.Process(fetcher.worker_memory()[0]["pid"])
      assert slabs_held(victim.pid) >= 1
      victim.send_signal(signal.SIGKILL)  # not reaped here: the fetcher reads its exit code
      with pytest.raises(WorkerError, match="killed by SIGKILL"):
        for i in range(1, 100):
          fetcher.get(0, i)
      assert got["pixels"][0] == 0  # what was received stays readable
    finally:
      fetcher.close()
  del got
  gc.collect()
  assert slabs_held() == 0
  assert not {e for e in shm_entries() - before if "bagel" in e or e.startswith("psm_")}


def test_the_main_process_killed_leaves_no_slab_and_no_worker_behind(tmp_path):
  script = tmp_path / "main_killed.py"
  script.write_text(textwrap.dedent("""
      import json, sys, time
      import numpy as np
      from big_elements import Pixels
      from bagel_grain.workers import Fetcher
      from bagel_grain.workers.arena import Arena

      if __name__ == "__main__":
        fetcher = Fetcher([Pixels(100, 1 << 20)], workers=2, depths=[4])
        while not all("at_ready" in w for w in fetcher.worker_memory()):
          time.sleep(0.05)
        held = [fetcher.get(0, i) for i in range(6)]
        # each worker copies an element of its slab into a batch arena: both map it
        arena = Arena.create({"pixels": ((6, 1 << 20), np.uint8)}, 1)
        _, arrays = arena.take()
        copies = {}
        for i, element in enumerate(held):
          found = fetcher.slab_of(element["pixels"])
          if found is not None:
            copies.setdefault(found[0], []).append((arena.where(arrays["pixels"][i]), found[1]))
        fetcher.copy_and_wait(arena, copies)
        print(json.dumps([w["pid"] for w in fetcher.worker_memory()]), flush=True)
        sys.stdin.read()  # until killed
      """))
  before = shm_entries()
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
  child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
  workers = []
  try:
    pids = json.loads(child.stdout.readline())
    workers = [psutil.Process(pid) for pid in pids]
    assert all(slabs_held(p.pid) >= 1 for p in workers)
    assert slabs_held(child.pid) == 2 * 2
    assert any(arenas_held(p.pid) >= 1 for p in workers) and arenas_held(child.pid) >= 2
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    gone, alive = psutil.wait_procs(workers, timeout=30)  # they see their socket close
    assert not alive
  finally:
    for p in workers:
      if p.is_running():
        p.kill()
    if child.poll() is None:
      child.kill()
    child.communicate()
  assert not {e for e in shm_entries() - before if "bagel" in e or e.startswith("psm_")}
