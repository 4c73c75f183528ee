"""Process memory as /proc tells it, split so that a leak and a shared mapping read apart.

A process's RSS mixes three kinds of page (`/proc/PID/status`): `RssAnon`, its own heap
and stacks (where a leak shows); `RssFile`, pages of files it maps (libraries, read
lazily as code first runs); `RssShmem`, pages of shared memory it maps (memfd,
/dev/shm) that it has touched, which count in every process that touches them. The
last is bounded by the size of those mappings (`shared_mapped_mib`, from
`/proc/PID/maps`), whatever writes them. Nothing here knows what the pipeline puts in
shared memory: only /proc is read, so the soak judges any scheme alike.
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections import Counter
from typing import Callable

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
# Shared mappings whose resident pages count as RssShmem (tmpfs, memfd, SysV, MAP_SHARED
# of anonymous memory): a shared map of a file on disk counts as RssFile instead.
_SHMEM_PATHS = ("/memfd:", "/dev/shm/", "/SYSV", "/dev/zero")


def status_mib(pid: int) -> dict[str, float] | None:
  """The process's RSS and its split, and its peak RSS since the last `reset_peak`
  (`VmHWM`), in MiB, and its number of threads; None once it is gone."""
  out = {}
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key in FIELDS or key == "VmHWM":
          out[key] = int(value.split()[0]) / 1024  # kB
        elif key == "Threads":  # each may hold a C heap arena of its own
          out[key] = int(value)
  except OSError:
    return None
  return out


def shared_mapped_mib(pid: int) -> float | None:
  """The size of the process's shared-memory mappings: the most its RssShmem can reach."""
  total = 0
  try:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
      for line in f:
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) > 5 else ""
        if parts[1][3] == "s" and (not path or path.startswith(_SHMEM_PATHS)):
          start, end = (int(x, 16) for x in parts[0].split("-"))
          total += end - start
  except OSError:
    return None
  return total / 2**20


def reset_peak(pid: int) -> bool:
  """Restarts the process's `VmHWM` from its RSS now (`clear_refs` 5): each half of a run
  then has its own true peak, not one sampled. False where the kernel refuses."""
  try:
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    return True
  except OSError:
    return False


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def malloc_mib() -> dict[str, float] | None:
  """This process's C heap (glibc's `mallinfo2`): bytes in use (what a native leak grows)
  and bytes freed but kept (what fragmentation grows); None off glibc 2.33+."""
  try:
    call = ctypes.CDLL(None).mallinfo2
  except (OSError, AttributeError):
    return None
  call.restype = _MallInfo2
  m = call()
  return {"in_use": round((m.uordblks + m.hblkhd) / 2**20, 1),
          "free_kept": round(m.fordblks / 2**20, 1)}


def object_counts() -> Counter:
  """Live objects the collector tracks, by type name: what a Python-level leak grows."""
  return Counter(type(o).__name__ for o in gc.get_objects())


class Watch:
  """Samples every `every` seconds, in a thread, the memory of the processes `processes()`
  names ({name: pid}); at `half` seconds takes each one's peak RSS so far and restarts it,
  and counts this process's live objects (and its traced allocations where `tracemalloc`
  was started), so that `summary()` sets the two halves side by side."""

  def __init__(self, processes: Callable[[], dict[str, int]], half: float,
               every: float = 1.0):
    self._processes, self._half, self._every = processes, half, every
    self.series: dict[str, list[tuple[float, dict[str, float]]]] = {}
    self.shared: dict[str, float] = {}  # name: the largest shared mapping seen (MiB)
    self._hwm: dict[str, list[float]] = {}  # name: [peak of the first half, of the second]
    self._objects: list[Counter] = []
    self._malloc: list[dict[str, float] | None] = []  # the C heap at each half's end
    self._arrow: list[float] = []  # MiB Arrow's memory pool holds, at each half's end
    self._traces: list[tracemalloc.Snapshot] = []
    self._pids: dict[str, int] = {}
    self.load: list[float] = []  # the machine's 1-minute load average at each sample
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._start = time.monotonic()
    self._halved = False
    self._thread = threading.Thread(target=self._loop, name="soak-memory", daemon=True)

  def start(self) -> "Watch":
    for name, pid in self._processes().items():
      reset_peak(pid)
    self._thread.start()
    return self

  def _loop(self) -> None:
    while not self._stop.wait(self._every):
      self.sample()

  def sample(self) -> None:
    """One sample of every process now; the halfway mark once it is due."""
    with self._lock:
      now = time.monotonic() - self._start
      self.load.append(os.getloadavg()[0])
      if not self._halved and now >= self._half:
        self._mark_half()
      for name, pid in self._processes().items():
        self._pids[name] = pid
        s = status_mib(pid)
        if s is None:
          continue
        self.series.setdefault(name, []).append((round(now, 2), s))
        mapped = shared_mapped_mib(pid)
        if mapped is not None:
          self.shared[name] = max(self.shared.get(name, 0.0), mapped)

  def latest(self, name: str) -> dict[str, float] | None:
    with self._lock:
      samples = self.series.get(name)
      return samples[-1][1] if samples else None

  def _snapshot_python(self) -> None:
    self._objects.append(object_counts())
    self._malloc.append(malloc_mib())
    arrow = sys.modules.get("pyarrow")
    self._arrow.append(arrow.total_allocated_bytes() / 2**20 if arrow else 0.0)
    if tracemalloc.is_tracing():
      self._traces.append(tracemalloc.take_snapshot())

  def _mark_half(self) -> None:
    self._halved = True
    for name, pid in self._processes().items():
      s = status_mib(pid)
      if s is not None and "VmHWM" in s:
        self._hwm[name] = [s["VmHWM"]]
      reset_peak(pid)
    self._snapshot_python()

  def stop(self) -> None:
    """The last sample, the second half's peaks and object counts; call before the
    pipeline closes (its workers are still there)."""
    self._stop.set()
    self._thread.join()
    self.sample()
    with self._lock:
      for name, pid in self._pids.items():
        s = status_mib(pid)
        if s is not None and name in self._hwm:
          self._hwm[name].append(s["VmHWM"])
      if self._halved:
        self._snapshot_python()

  def summary(self, anon_tolerance_mib: float) -> dict:
    """Per process and half: peak and median of each field, true peak RSS (`VmHWM`),
    growth; the verdict: flat when no process's anonymous memory grew by more than
    `anon_tolerance_mib` from the first half to the second (peak and median both), and
    no process's shared pages exceed its shared mappings."""
    processes, reasons = {}, []
    for name, samples in self.series.items():
      p = _halves(samples, self._half)
      p["shared_mapped_mib"] = round(self.shared.get(name, 0.0), 1)
      hwm = self._hwm.get(name, [])
      if len(hwm) == 2:
        p["peak_rss_hwm"] = {"first_half": round(hwm[0], 1), "second_half": round(hwm[1], 1),
                             "growth": round(hwm[1] - hwm[0], 1)}
      processes[name] = p
      growth = p.get("growth")
      if growth is None:
        continue  # seen in one half only (a worker replaced): the exit status says so
      for key in ("RssAnon_peak", "RssAnon_median"):
        if growth[key] > anon_tolerance_mib:
          reasons.append(f"{name}: {key} grew {growth[key]} MiB (> {anon_tolerance_mib})")
      shmem = max(s["RssShmem"] for _, s in samples)
      if shmem > self.shared.get(name, 0.0) + 1:  # + 1: a mapping may come and go between samples
        reasons.append(f"{name}: RssShmem {shmem:.1f} MiB over its shared mappings "
                       f"{self.shared.get(name, 0.0):.1f} MiB")
    heap = self._malloc
    if len(heap) == 2 and None not in heap and any(r.startswith("main:") for r in reasons):
      reasons.append(  # a leak grows the heap in use; allocator retention, the freed part
          f"main: C heap in use {heap[0]['in_use']} -> {heap[1]['in_use']} MiB, freed but "
          f"kept {heap[0]['free_kept']} -> {heap[1]['free_kept']} MiB")
    out = {"processes": processes, "anon_tolerance_mib": anon_tolerance_mib,
           "flat": not reasons, "reasons": reasons}
    if self.load:
      out["load_average_1min"] = {"min": min(self.load), "median": statistics.median(self.load),
                                  "max": max(self.load)}
    if len(self._objects) == 2:
      grown = self._objects[1].copy()
      grown.subtract(self._objects[0])
      out["main_objects"] = {"first_half_end": sum(self._objects[0].values()),
                             "second_half_end": sum(self._objects[1].values()),
                             "top_growth": dict(grown.most_common(10)),
                             "arrow_pool_mib": [round(m, 1) for m in self._arrow],
                             "c_heap_mib": self._malloc}
    if len(self._traces) == 2:
      diff = self._traces[1].compare_to(self._traces[0], "lineno")[:10]
      out["main_tracemalloc_top_growth"] = [
          f"{d.traceback[0].filename}:{d.traceback[0].lineno} {d.size_diff / 2**20:+.2f} MiB "
          f"({d.count_diff:+d} blocks)" for d in diff]
      out["main_tracemalloc_top_stacks"] = [
          [f"{d.size_diff / 2**20:+.2f} MiB ({d.count_diff:+d} blocks)"] + d.traceback.format()
          for d in self._traces[1].compare_to(self._traces[0], "traceback")[:3]]
    return out

  def series_json(self) -> dict:
    return {name: [{"t": t, **{k: round(v, 1) for k, v in s.items()}} for t, s in samples]
            for name, samples in self.series.items()}


def _halves(samples: list[tuple[float, dict[str, float]]], half: float) -> dict:
  """Each half's peak and median of every field, and their growth (second - first)."""
  parts = {"first_half": [s for t, s in samples if t < half],
           "second_half": [s for t, s in samples if t >= half]}
  out: dict = {}
  for part, rows in parts.items():
    if rows:
      out[part] = {f"{k}_{how}": round(f([r[k] for r in rows]), 1)
                   for k in FIELDS + ("Threads",)
                   for how, f in (("peak", max), ("median", statistics.median))}
      out[part]["samples"] = len(rows)
  if len(out) == 2:
    out["growth"] = {k: round(out["second_half"][k] - out["first_half"][k], 1)
                     for k in out["first_half"] if k != "samples"}
  return out
