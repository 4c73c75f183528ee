"""2 workers against 0 on a 2-core machine: the CPU of every process per row, and knobs.

  python tools/worker_scaling.py ROUNDS 'NAME|TREE|DATA|WORKERS|ROWS|K=V,K=V' ...

Runs each variant (a code tree, a data folder, a worker count, packed rows to time after
3 warm-up rows, knobs) in a fresh interpreter with `PYTHONPATH` set to its tree, the
variants alternating (their order flipped each round), and prints per run: rows/s, the
CPU per row of the main process and of each worker (all their threads), the samples the
main process decoded itself and their CPU each, the samples the workers sent and the
workers' CPU per sample, when the workers said hello and were up (seconds from the
build) against the start of the timed rows, and the cores the run used beside those the
whole machine used (`/proc/stat`); then the medians.

It also prints, per process and per kind of thread (the main process: main, inline,
pump, other = read-ahead; a worker: main = messages and the batches' copies, compute =
its busiest other thread, other = read-ahead), the CPU and the system CPU per row and
the minor page faults per row, from `/proc/PID/task/TID/stat`.

Knobs (environment of the run): BG_PROBE_NICE (the workers' niceness above the main
process, `process.WORKER_NICENESS`), BG_PROBE_JOBS (`fetcher.JOBS_PER_WORKER`),
BG_PROBE_TAKEOVER (`fetcher.TAKE_OVER_AFTER_S`, where the tree has it),
BG_PROBE_WAIT_READY=1 (the warm-up goes on until every worker is up, then 3 more rows).
BOOST=-20 in the driver's environment: the driver moves into a session of its own and
sets that autogroup's niceness (root), so that other sessions' jobs on a shared machine
get a few percent of the CPU (as `tools/ceiling_bars.py --alone`).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def _proc_stat():
  with open("/proc/stat", encoding="ascii") as f:
    parts = [int(x) for x in f.readline().split()[1:]]
  idle = parts[3] + parts[4]
  return sum(parts) - idle, sum(parts)


def _threads(pid: int) -> dict[int, tuple[float, float, int]]:
  """Per thread of `pid`: (user + system CPU seconds, system CPU seconds, minor faults)."""
  tick, out = os.sysconf("SC_CLK_TCK"), {}
  try:
    tids = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return out
  for tid in tids:
    try:
      with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    out[int(tid)] = ((int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick,
                     int(fields[7]))
  return out


def _by_thread(pid: int, before: dict, after: dict, names: dict[int, str]) -> dict:
  """CPU, system CPU and minor faults of one process over the window, summed by the kind of
  thread: "main" (the process's first thread), those `names` names, the rest "other"
  (read-ahead); in a worker, its busiest thread besides main is "compute"."""
  spent = {tid: tuple(a - b for a, b in zip(v, before.get(tid, (0.0, 0.0, 0))))
           for tid, v in after.items()}
  names = dict(names)
  others = [t for t in spent if t != pid and t not in names]
  if not names and others:  # a worker (or another child)
    names[max(others, key=lambda t: spent[t][0])] = "compute"
  out: dict[str, list] = {}
  for tid, (cpu, sys_cpu, faults) in spent.items():
    kind = "main" if tid == pid else names.get(tid, "other")
    got = out.setdefault(kind, [0.0, 0.0, 0])
    got[0] += cpu
    got[1] += sys_cpu
    got[2] += faults
  return out


def child(data: str, workers: int, rows: int, warmup: int) -> dict:
  import psutil
  import bagel_grain
  from bagel_grain.configs import load_shipped
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.workers import fetcher as F, process as P
  from bagel_grain.tooling import bench
  knobs = {k: v for k, v in os.environ.items() if k.startswith("BG_PROBE_")}
  if "BG_PROBE_NICE" in knobs:
    P.WORKER_NICENESS = int(knobs["BG_PROBE_NICE"])
  if "BG_PROBE_JOBS" in knobs:
    F.JOBS_PER_WORKER = int(knobs["BG_PROBE_JOBS"])
  if "BG_PROBE_TAKEOVER" in knobs:
    F.TAKE_OVER_AFTER_S = float(knobs["BG_PROBE_TAKEOVER"])
  received = [0]
  real_recv = F.recv

  def counting_recv(conn, slab=None):
    got = real_recv(conn, slab)
    if got[0] != "copied":
      received[0] += 1
    return got
  F.recv = counting_recv
  ready_at = {}
  real_starting = F.Fetcher._starting

  def starting(self, w, message):
    ready_at.setdefault(message, []).append(time.perf_counter())
    return real_starting(self, w, message)
  F.Fetcher._starting = starting
  cfg = load_shipped("bench", data)
  t0 = time.perf_counter()
  it = iter(build_pipeline(cfg, bagel_grain.load_tokenizer(cfg.tokenizer_path), batch_size=1,
                           workers=workers))
  me = psutil.Process()
  try:
    for _ in range(warmup):
      next(it)
    if knobs.get("BG_PROBE_WAIT_READY") and workers:
      while len(ready_at.get("ready", [])) < workers:
        next(it)
      for _ in range(warmup):
        next(it)
    fetchers = F.live()
    kids = me.children(recursive=True)

    def kid_cpu():
      out = {}
      for k in kids:
        try:
          t = k.cpu_times()
          out[k.pid] = t.user + t.system
        except psutil.Error:
          out[k.pid] = 0.0
      return out
    pids = [os.getpid()] + [k.pid for k in kids]
    threads0 = {pid: _threads(pid) for pid in pids}
    k0 = kid_cpu()
    inl0 = (sum(f.inline_elements for f in fetchers), sum(f.inline_cpu_s for f in fetchers))
    rec0 = received[0]
    th0 = bench._thread_cpu()
    parts0 = it.cpu_seconds() if hasattr(it, "cpu_seconds") else None
    s0 = _proc_stat()
    done0 = pipeline_stats(it)["rows"]
    t_start = time.perf_counter()
    cpu = time.process_time()
    while pipeline_stats(it)["rows"] - done0 < rows:
      next(it)
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - t_start
    s1 = _proc_stat()
    k1 = kid_cpu()
    threads1 = {pid: _threads(pid) for pid in pids}
    names = {fetchers[0]._inline.native_id: "inline"} if fetchers else {}
    if fetchers and fetchers[0]._pump is not None:
      names[fetchers[0]._pump.native_id] = "pump"
    kinds = [_by_thread(pid, threads0[pid], threads1[pid], names if pid == os.getpid() else {})
             for pid in pids]
    th = {k: v - th0[k] for k, v in bench._thread_cpu().items()}
    if parts0 is not None:
      parts = bench._parts(th, {k: v - parts0[k] for k, v in it.cpu_seconds().items()})
    else:
      parts = th
    done = pipeline_stats(it)["rows"] - done0
    inl = (sum(f.inline_elements for f in fetchers) - inl0[0],
           sum(f.inline_cpu_s for f in fetchers) - inl0[1])
    rec = received[0] - rec0
    worker_cpu = {pid: k1[pid] - k0.get(pid, 0.0) for pid in k1}
  finally:
    it.close()
  busy = (s1[0] - s0[0]) / os.sysconf("SC_CLK_TCK")
  ours = cpu + sum(worker_cpu.values())
  return {"workers": workers, "knobs": knobs, "rows": done, "wall_s": wall,
          "rows_per_s": done / wall,
          "main_ms_row": cpu / done * 1e3,
          "workers_ms_row": [v / done * 1e3 for v in worker_cpu.values()],
          "total_ms_row": ours / done * 1e3,
          "parts_ms_row": {k: v / done * 1e3 for k, v in parts.items()},
          "inline_elements": inl[0], "inline_ms_each": inl[1] / max(1, inl[0]) * 1e3,
          "worker_elements": rec,
          "worker_ms_each": sum(worker_cpu.values()) / max(1, rec) * 1e3,
          "ready_s": sorted(v - t0 for v in ready_at.get("ready", [])),
          "hello_s": sorted(v - t0 for v in ready_at.get("hello", [])),
          "window_start_s": t_start - t0,
          "cores_busy_ours": ours / wall, "cores_busy_all": busy / wall,
          "load": os.getloadavg()[0],
          # per process (main first, then its children), per kind of thread: CPU ms per
          # row, system CPU ms per row, minor faults per row
          "threads_per_row": [{k: [v[0] / done * 1e3, v[1] / done * 1e3, v[2] / done]
                               for k, v in sorted(kind.items())} for kind in kinds]}


def run(tree, data, workers, rows, env):
  e = {**os.environ, "PYTHONPATH": tree, **env}
  done = subprocess.run([sys.executable, __file__, "--child", data, str(workers), str(rows), "3"],
                        cwd=tree, env=e, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(done.stderr[-3000:])
  return json.loads(done.stdout.strip().splitlines()[-1])


def main():
  if sys.argv[1] == "--child":
    data, workers, rows, warmup = sys.argv[2:6]
    print(json.dumps(child(data, int(workers), int(rows), int(warmup))))
    return
  if os.environ.get("BOOST"):  # a fresh autogroup (setsid) at nice -20: as if alone
    if os.getsid(0) != os.getpid():
      os.setsid()
    with open("/proc/self/autogroup", "w", encoding="ascii") as f:
      f.write(os.environ["BOOST"])
    with open("/proc/self/autogroup", encoding="ascii") as f:
      print(f.read().strip(), flush=True)
  rounds = int(sys.argv[1])
  variants = []
  for spec in sys.argv[2:]:
    name, tree, data, workers, rows, kv = (spec.split("|") + [""])[:6]
    env = dict(x.split("=", 1) for x in kv.split(",") if x)
    variants.append((name, tree, data, int(workers), int(rows), env))
  results = {v[0]: [] for v in variants}
  start = time.time()
  for r in range(rounds):
    order = variants if r % 2 == 0 else variants[::-1]
    for name, tree, data, workers, rows, env in order:
      got = run(tree, data, workers, rows, env)
      results[name].append(got)
      print(f"[{time.time() - start:4.0f}s] r{r} {name}: {got['rows_per_s']:.2f} rows/s, main "
            f"{got['main_ms_row']:.0f} ms/row, workers "
            f"{[round(x) for x in got['workers_ms_row']]}, total {got['total_ms_row']:.0f}; "
            f"inline {got['inline_elements']} x {got['inline_ms_each']:.0f} ms, worker elems "
            f"{got['worker_elements']} x {got['worker_ms_each']:.0f} ms; ready "
            f"{[round(x, 1) for x in got['hello_s']]}/{[round(x, 1) for x in got['ready_s']]} "
            f"window at {got['window_start_s']:.1f}s; "
            f"cores ours {got['cores_busy_ours']:.2f} all {got['cores_busy_all']:.2f}; "
            f"load {got['load']:.1f}; parts "
            + ", ".join(f"{k} {v:.1f}" for k, v in got['parts_ms_row'].items()), flush=True)
      print("      threads (CPU / system ms per row, faults per row): " + "; ".join(
          ("main " if i == 0 else f"child {i} ") + ", ".join(
              f"{k} {v[0]:.1f}/{v[1]:.1f}/{v[2]:.0f}" for k, v in kind.items())
          for i, kind in enumerate(got["threads_per_row"]) if kind), flush=True)
  print("medians:")
  for name, got in results.items():
    med = lambda k: statistics.median(g[k] for g in got)
    print(f"  {name}: {med('rows_per_s'):.2f} rows/s, main {med('main_ms_row'):.0f}, total "
          f"{med('total_ms_row'):.0f} ms/row, inline {med('inline_elements')}, cores ours "
          f"{med('cores_busy_ours'):.2f} all {med('cores_busy_all'):.2f}")
  if os.environ.get("JSON"):
    with open(os.environ["JSON"], "w", encoding="utf-8") as f:
      json.dump(results, f)


if __name__ == "__main__":
  main()
