"""Process memory as /proc tells it, split so that a leak and a shared mapping read apart.

A process's RSS mixes three kinds of page (`/proc/PID/status`): `RssAnon`, its own heap
and stacks (where a leak shows); `RssFile`, pages of files it maps (libraries, read
lazily as code first runs); `RssShmem`, pages of shared memory it maps (memfd,
/dev/shm) that it has touched, which count in every process that touches them. The
last is bounded by the size of those mappings (`shared_mapped_mib`, from
`/proc/PID/maps`), whatever writes them. Nothing here knows what the pipeline puts in
shared memory: only /proc is read, so the soak judges any scheme alike.

Where a process's anonymous pages lie (`anon_split_mib`, from `/proc/PID/smaps`) tells
which allocator holds them: glibc's main arena, its per-thread arenas, thread stacks,
or other mappings (pymalloc's arenas, Arrow's pools, malloc's large blocks). For the
process itself, `pymalloc_arenas` and `arrow_pool_mib` count the last ones' users.
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


_ARENA_RESERVE = 64 << 20  # a glibc thread arena's heap: reserved, aligned, used from its start
# mimalloc (Arrow's default pool) asks for its segments at addresses from 2 TiB up, which
# nothing else here asks for (the kernel places other mappings near the top, 128 TiB).
_MIMALLOC_HINTS = (2 << 40, 32 << 40)


def _mappings(pid: int):
  """(start, end, perms, path, anonymous bytes) of each mapping in /proc/PID/smaps."""
  out, current = [], None
  with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
    for line in f:
      key, _, rest = line.partition(" ")
      if "-" in key and not key.endswith(":"):  # a mapping's header line
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        current = [start, end, parts[1], parts[5].strip() if len(parts) > 5 else "", 0]
        out.append(current)
      elif key == "Anonymous:" and current is not None:
        current[4] = int(rest.split()[0]) * 1024
  return out


def anon_split_mib(pid: int) -> dict[str, float] | None:
  """The process's anonymous pages by origin, in MiB, from the layout of its mappings:
  `heap` (glibc's main arena, `[heap]`), `thread_arenas` (glibc's other arenas: each a
  64 MiB reservation whose used start is readable and writable), `stacks` (the main
  thread's, and each thread's: a guard page, then its stack), `mimalloc` (mappings at
  mimalloc's hinted addresses: Arrow's default pool), `other_anon` (every other
  anonymous mapping: malloc's large blocks, pymalloc's arenas, Arrow's jemalloc pool,
  numpy's large arrays; the kernel merges adjacent ones, so they are not told apart) and `file_private` (pages of mapped files written by this process). None once
  the process is gone."""
  try:
    maps = _mappings(pid)
  except OSError:
    return None
  return split_mappings(maps)


def split_mappings(maps: list) -> dict[str, float]:
  """`anon_split_mib` of mappings as `_mappings` lists them (start, end, perms, path,
  anonymous bytes), in address order."""
  out = dict.fromkeys(("heap", "thread_arenas", "stacks", "mimalloc", "other_anon",
                       "file_private"), 0)
  for i, (start, end, perms, path, anon) in enumerate(maps):
    before = maps[i - 1] if i else None
    after = maps[i + 1] if i + 1 < len(maps) else None
    if path == "[heap]":
      kind = "heap"
    elif path.startswith("[stack"):
      kind = "stacks"
    elif path:
      kind = "file_private"
    elif _MIMALLOC_HINTS[0] <= start < _MIMALLOC_HINTS[1]:
      kind = "mimalloc"
    elif (start % _ARENA_RESERVE == 0 and end - start <= _ARENA_RESERVE
          and (end - start == _ARENA_RESERVE or (after is not None and after[0] == end
                                                 and after[2].startswith("---")
                                                 and after[1] - start <= _ARENA_RESERVE))):
      kind = "thread_arenas"
    elif (before is not None and before[1] == start and before[2].startswith("---")
          and not before[3] and before[1] - before[0] <= 64 << 10):
      kind = "stacks"  # a pthread stack sits right above its guard page
    else:
      kind = "other_anon"
    out[kind] += anon
  return {k: round(v / 2**20, 1) for k, v in out.items()}


def pymalloc_arenas() -> int | None:
  """How many 1 MiB arenas CPython's small-object allocator holds in this process now
  (from `sys._debugmallocstats`, which writes to the C stderr); None where unknown."""
  import tempfile  # pylint: disable=import-outside-toplevel
  if not hasattr(sys, "_debugmallocstats"):
    return None
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as f:
    try:
      os.dup2(f.fileno(), 2)
      sys._debugmallocstats()  # pylint: disable=protected-access
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    f.seek(0)
    text = f.read().decode("ascii", "replace")
  for line in text.splitlines():
    if line.startswith("# arenas allocated current"):
      return int(line.rpartition("=")[2].replace(",", ""))
  return None


def arrow_pool_mib() -> dict[str, float] | None:
  """Arrow's memory in this process: what its jemalloc pool (the one the parquet source
  decodes into) holds now and at most, and what its default pool holds now."""
  arrow = sys.modules.get("pyarrow")
  if arrow is None:
    return None
  out = {"total_allocated": round(arrow.total_allocated_bytes() / 2**20, 1)}
  try:
    pool = arrow.jemalloc_memory_pool()
    out.update(jemalloc_allocated=round(pool.bytes_allocated() / 2**20, 1),
               jemalloc_max=round(pool.max_memory() / 2**20, 1))
  except NotImplementedError:
    pass
  default = arrow.default_memory_pool()
  out[f"default_{default.backend_name}_allocated"] = round(default.bytes_allocated() / 2**20, 1)
  return out


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
    self._arrow: list[dict | None] = []  # Arrow's pools, at each half's end
    self._pymalloc: list[int | None] = []  # pymalloc's arenas, at each half's end
    self._held: list[dict | None] = []  # what the pipelines here hold (MiB), each half's end
    self._split: dict[str, list[dict[str, float]]] = {}  # name: anon_split_mib per half end
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
    self._arrow.append(arrow_pool_mib())
    self._pymalloc.append(pymalloc_arenas())
    held = sys.modules.get("bagel_grain.held_memory")  # read-ahead bytes, row-group caches
    self._held.append(None if held is None else {
        k: round(v / 2**20, 1) for k, v in held.snapshot().items() if k != "rss_bytes"})
    if tracemalloc.is_tracing():
      self._traces.append(tracemalloc.take_snapshot())

  def _mark_half(self) -> None:
    self._halved = True
    for name, pid in self._processes().items():
      s = status_mib(pid)
      if s is not None and "VmHWM" in s:
        self._hwm[name] = [s["VmHWM"]]
      reset_peak(pid)
      self._split_at_half_end(name, pid)
    self._snapshot_python()

  def _split_at_half_end(self, name: str, pid: int) -> None:
    split = anon_split_mib(pid)
    if split is not None:
      self._split.setdefault(name, []).append(split)

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
        if name in self._split:
          self._split_at_half_end(name, pid)
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
      split = self._split.get(name, [])
      if len(split) == 2:  # where the anonymous pages are, at each half's end
        p["anon_split_mib"] = {"first_half_end": split[0], "second_half_end": split[1],
                               "growth": {k: round(split[1][k] - split[0][k], 1)
                                          for k in split[0]}}
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
                             "arrow_pool_mib": self._arrow,
                             "pymalloc_arenas": self._pymalloc,
                             "held_by_pipeline_mib": self._held,
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


def malloc_info_xml() -> str | None:
  """glibc's `malloc_info(0, ...)` of this process: an XML element per arena (`heap`),
  with its free chunks by size, its size now and at most; None off glibc."""
  try:
    libc = ctypes.CDLL(None)
    libc.malloc_info  # pylint: disable=pointless-statement
  except (OSError, AttributeError):
    return None
  libc.open_memstream.restype = ctypes.c_void_p
  libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.POINTER(ctypes.c_size_t)]
  libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
  libc.fclose.argtypes = [ctypes.c_void_p]
  libc.free.argtypes = [ctypes.c_void_p]
  buf, size = ctypes.c_void_p(), ctypes.c_size_t()
  stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
  if not stream:
    return None
  try:
    libc.malloc_info(0, stream)
  finally:
    libc.fclose(stream)
  try:
    return ctypes.string_at(buf, size.value).decode("ascii", "replace")
  finally:
    libc.free(buf)


def malloc_arenas(xml: str | None = None) -> list[dict] | None:
  """Per glibc arena of this process (from `malloc_info`), MiB: its size (`system`),
  what is free in it (`free`: fast bins and the rest), of that what lies in free chunks
  of 128 KiB or more (`free_large`), its top chunk (`top`: free memory at the end of
  the arena, which `malloc_trim` leaves in a thread arena), its largest free chunk size
  class (`largest_free`, the top of it), and how many free chunks it holds. The main
  arena is nr 0."""
  import xml.etree.ElementTree as ET  # pylint: disable=import-outside-toplevel
  xml = malloc_info_xml() if xml is None else xml
  if xml is None:
    return None
  out = []
  for heap in ET.fromstring(xml).iter("heap"):
    sizes = heap.find("sizes")
    chunks = [(int(s.get("from")), int(s.get("to")), int(s.get("total")), int(s.get("count")))
              for s in (sizes if sizes is not None else []) if s.tag == "size"]
    free = sum(int(t.get("size")) for t in heap.findall("total")
               if t.get("type") in ("fast", "rest"))
    unsorted = sum(int(s.get("total")) for s in (sizes if sizes is not None else [])
                   if s.tag == "unsorted")
    top = free - sum(t for *_, t, _ in chunks) - unsorted  # "rest" counts the top chunk
    system = {s.get("type"): int(s.get("size")) for s in heap.findall("system")}
    out.append({
        "nr": int(heap.get("nr")),
        "system": round(system.get("current", 0) / 2**20, 1),
        "system_max": round(system.get("max", 0) / 2**20, 1),
        "free": round(free / 2**20, 1),
        "top": round(top / 2**20, 1),
        "free_large": round(sum(t for f, _, t, _ in chunks if f >= 128 << 10) / 2**20, 1),
        "largest_free": round(max((to for _, to, _, _ in chunks), default=0) / 2**20, 2),
        "free_chunks": sum(c for *_, c in chunks)})
  return out


_M_MMAP_THRESHOLD = -3
_PROBE_SIZES = tuple(k << 17 for k in (1, 2, 4, 8, 16, 32, 64, 128, 256))  # 128 KiB .. 32 MiB


def mmap_threshold_probe() -> int | None:
  """The smallest of `_PROBE_SIZES` that glibc's `malloc` serves by `mmap` now: glibc
  starts at 128 KiB and raises the threshold to the size of each mmapped block freed
  (up to 32 MiB), after which blocks below it come from the arenas. Found by allocating
  and freeing a block of each size in turn (the chunk header's IS_MMAPPED bit); None off
  glibc, 0 when none of the sizes was mmapped. A bound from above (a smaller block may
  have come from free memory), and not without effect: where glibc still moves its
  threshold, freeing the mmapped probe raises it to that size."""
  try:
    libc = ctypes.CDLL(None)
  except OSError:
    return None
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  for size in _PROBE_SIZES:
    p = libc.malloc(size)
    if not p:
      return None
    mmapped = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2
    libc.free(p)
    if mmapped:
      return size
  return 0


def set_mmap_threshold(size: int) -> bool:
  """`mallopt(M_MMAP_THRESHOLD, size)` in this process: blocks of `size` or more always
  come from `mmap`, and glibc stops moving the threshold (an experiment's knob)."""
  try:
    return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, size))
  except (OSError, AttributeError):
    return False


def thread_arena_mib(pid: int) -> list[float] | None:
  """The anonymous MiB of each of the process's glibc thread arenas (as `split_mappings`
  tells them), in address order."""
  try:
    maps = _mappings(pid)
  except OSError:
    return None
  out = []
  for i, (start, end, _, path, anon) in enumerate(maps):
    after = maps[i + 1] if i + 1 < len(maps) else None
    if (not path and not _MIMALLOC_HINTS[0] <= start < _MIMALLOC_HINTS[1]
        and start % _ARENA_RESERVE == 0 and end - start <= _ARENA_RESERVE
        and (end - start == _ARENA_RESERVE or (after is not None and after[0] == end
                                               and after[2].startswith("---")
                                               and after[1] - start <= _ARENA_RESERVE))):
      out.append(round(anon / 2**20, 1))
  return out
