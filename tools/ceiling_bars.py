"""Every bar of the host-ceiling issue in one table, from one script run alone on the machine.

  python tools/ceiling_bars.py                      # this tree, against a24d1ac
  python tools/ceiling_bars.py --baseline none      # this tree only (quicker)
  python tools/ceiling_bars.py --alone --steady     # on a shared machine (root); and 2
                                                    # workers timed once they are up

What it measures, each run a fresh interpreter with `PYTHONPATH` set to its tree, the
runs of one kind alternating (variants and trees, their order flipped each round),
medians over `--rounds`:

- the simulated ceiling (`tools/main_ceiling.py`: replayed pre-decoded samples served as
  fast as the main process takes them): its CPU per row by part, and 1 / that in rows/s
  and packed tokens/s;
- the bench data (`--data`, `bagel-grain make-bench-data` writes it) and a 120-row
  lab-like mixture (`--mixture`, written here if missing: photos of 0.3-2 MP in all
  three families), `--rows` and `--mixture-rows` packed rows at 0 and 2 workers: rows/s
  (wall), 2 workers over 0 workers, the main process's CPU per row at 2 workers by part;
- peak memory per process from /proc (VmHWM; and the peaks of RssAnon, the process's own
  pages, and RssShmem, shared pages such as a worker's slab, counted in every process
  that touched them).

With a baseline commit it is checked out in a temporary `git worktree` (removed at
the end), and measured too: the ceiling, and 0 workers on the bench data (the bar:
0 workers no slower). About 8-10 minutes on 2 free cores with the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from proc_memory import status_mib  # tools/, this script's folder

ROOT = Path(__file__).resolve().parents[1]
MIXTURE_ROWS = {"t2i": 120, "edit": 40, "vlm": 80}  # records, cycled by the pipeline's epochs
_STATUS = ("VmHWM", "RssAnon", "RssShmem")  # the lines of `status_mib` kept


class _Peaks:
  """Peaks of each `_STATUS` line, for this process and each child, sampled in a thread."""

  def __init__(self, pid: int | None = None, interval: float = 0.1):
    import psutil  # pylint: disable=import-outside-toplevel
    self._me, self._stop, self._interval = psutil.Process(pid), threading.Event(), interval
    self.peaks: dict[int, dict[str, float]] = {}
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _sample(self) -> None:
    import psutil  # pylint: disable=import-outside-toplevel
    try:
      children = self._me.children(recursive=True)
    except psutil.Error:  # the process has exited
      return
    for pid in [self._me.pid] + [c.pid for c in children]:
      seen = self.peaks.setdefault(pid, {})
      for key, value in (status_mib(pid) or {}).items():
        if key in _STATUS:
          seen[key] = max(seen.get(key, 0), value)

  def _run(self) -> None:
    while not self._stop.wait(self._interval):
      self._sample()

  def stop(self) -> dict[str, list[dict[str, float]]]:
    """{"main": [MiB by line], "workers": [...]}: peaks per process."""
    self._stop.set()
    self._thread.join()
    self._sample()
    mib = dict(self.peaks)
    return {"main": [mib.pop(self._me.pid, {})],
            "workers": [p for p in mib.values() if p.get("VmHWM", 0) > 100]}


def _busy_cores_s() -> float:
  """CPU seconds the whole machine has spent busy (not idle, not waiting for I/O)."""
  with open("/proc/stat", encoding="ascii") as f:
    ticks = [int(x) for x in f.readline().split()[1:]]
  return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _workers_up() -> bool:
  """Whether every worker of this process's fetchers has loaded its datasets."""
  from bagel_grain.workers import fetcher  # pylint: disable=import-outside-toplevel
  return all(w.stage == "ready" for f in fetcher.live()
             for w in f._workers)  # pylint: disable=protected-access


def child(data: str, workers: int, rows: int, warmup: int, steady: bool = False) -> dict:
  """One run of the tree on `PYTHONPATH`: the bench config on `data`, batch size 1,
  `warmup` rows then `rows` rows; with `steady`, the warm-up rows are counted from
  the moment every worker is up (the timed rows then exclude the workers' start-up)."""
  # pylint: disable=import-outside-toplevel,protected-access
  import psutil
  import bagel_grain
  from bagel_grain.configs import load_shipped
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.tooling import bench
  cfg = load_shipped("bench", data)
  it = iter(build_pipeline(cfg, bagel_grain.load_tokenizer(cfg.tokenizer_path), batch_size=1,
                           workers=workers))
  try:
    for _ in range(warmup):
      next(it)
    if steady:
      while not _workers_up():
        next(it)
      for _ in range(warmup):
        next(it)
    up = _workers_up()
    kids = psutil.Process().children(recursive=True)

    def kids_cpu() -> float:
      total = 0.0
      for kid in kids:
        try:
          t = kid.cpu_times()
          total += t.user + t.system
        except psutil.Error:
          pass
      return total
    parts0 = it.cpu_seconds() if hasattr(it, "cpu_seconds") else None
    threads0, done0 = bench._thread_cpu(), pipeline_stats(it)["rows"]
    inline0 = bench._inline_work()[0] if hasattr(bench, "_inline_work") else 0
    kids0, busy0 = kids_cpu(), _busy_cores_s()
    cpu, wall, tokens = time.process_time(), time.perf_counter(), 0
    while pipeline_stats(it)["rows"] - done0 < rows:
      tokens += int(next(it)["num_tokens"].sum())
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ours, busy = cpu + kids_cpu() - kids0, _busy_cores_s() - busy0
    inline = (bench._inline_work()[0] if hasattr(bench, "_inline_work") else 0) - inline0
    done = pipeline_stats(it)["rows"] - done0
    threads = {k: v - threads0[k] for k, v in bench._thread_cpu().items()}
    if parts0 is not None:
      parts = bench._parts(threads, {k: v - parts0[k] for k, v in it.cpu_seconds().items()})
    else:
      parts = {"pump": threads["pump"], "placement + row writing": threads["main"],
               "decoding": threads["decode"], "other": threads["other"]}
  finally:
    it.close()
  return {"code": bagel_grain.__file__, "workers": workers, "rows": done, "wall_s": wall,
          "rows_per_s": done / wall, "tokens_per_s": tokens / wall,
          "main_cpu_ms_per_row": cpu / done * 1e3,
          "cpu_ms_per_row": ours / done * 1e3,  # main and workers
          "cores": ours / wall,  # this run's processes, on average over the timed rows
          "other_cores": max(0.0, busy - ours) / wall,  # everything else on the machine
          "workers_up": up, "decoded_in_main": inline,
          "parts_ms_per_row": {k: v / done * 1e3 for k, v in parts.items()}}


def _run(tree: Path, args: list[str]) -> dict:
  env = {**os.environ, "PYTHONPATH": str(tree)}
  done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                        text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"{args} on {tree} failed:\n{done.stderr[-3000:]}")
  return done


def ceiling(tree: Path, data: Path, rows: int) -> dict:
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    _run(tree, [str(ROOT / "tools" / "main_ceiling.py"), "--data", str(data), "--rows",
                str(rows), "--json", out.name])
    return json.loads(Path(out.name).read_text(encoding="utf-8"))


def pipeline(tree: Path, data: Path, workers: int, rows: int, warmup: int,
             steady: bool = False) -> dict:
  # Memory is sampled from here, not in the measured process: a sampler there (psutil
  # walks every process of the machine to find children) cost it 5-9 ms of CPU per row.
  args = [sys.executable, str(Path(__file__).resolve()), "--child", str(data), str(workers),
          str(rows), str(warmup)] + (["steady"] if steady else [])
  with subprocess.Popen(args, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child_:
    peaks = _Peaks(child_.pid)
    out, err = child_.communicate()
    memory = peaks.stop()
  if child_.returncode:
    raise RuntimeError(f"{args} on {tree} failed:\n{err[-3000:]}")
  return {**json.loads(out.strip().splitlines()[-1]), "memory_mib": memory}


def make_data(path: Path, mixture: bool) -> None:
  if (path / ".complete").exists():
    return
  extra = ([f"--{k}-rows={v}" for k, v in MIXTURE_ROWS.items()] + ["--megapixels", "0.3", "2"]
           if mixture else [])
  print(f"writing {path} ...", file=sys.stderr)
  subprocess.run([sys.executable, "-m", "bagel_grain.tooling.cli", "make-bench-data",
                  str(path), *extra], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                 check=True, capture_output=True)


def _median(runs: list[dict], *keys: str) -> float:
  def get(run):
    for k in keys:
      run = run[k]
    return run
  return statistics.median(get(r) for r in runs)


def _memory(runs: list[dict]) -> str:
  """Largest peak over runs, main and worker: total (VmHWM), anon, shared."""
  def most(kind, key):
    values = [p.get(key, 0) for r in runs for p in r["memory_mib"][kind]]
    return max(values) if values else 0.0
  out = [f"main {most('main', 'VmHWM'):.0f} (anon {most('main', 'RssAnon'):.0f}, "
         f"shared {most('main', 'RssShmem'):.0f})"]
  if any(r["memory_mib"]["workers"] for r in runs):
    out.append(f"worker {most('workers', 'VmHWM'):.0f} (anon {most('workers', 'RssAnon'):.0f}, "
               f"shared {most('workers', 'RssShmem'):.0f})")
  return "; ".join(out)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--data", default=".bench_data", help="the bench data (written if missing)")
  p.add_argument("--mixture", default=".lab_mixture", help="the lab-like mixture (likewise)")
  p.add_argument("--baseline", default="a24d1ac", help="a commit to compare, or 'none'")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--rows", type=int, default=40, help="timed rows per bench-data run")
  p.add_argument("--mixture-rows", type=int, default=120)
  p.add_argument("--ceiling-rows", type=int, default=200)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--steady", action="store_true",
                 help="also time 2 workers on the bench data from 3 rows after every worker "
                 "is up (without the workers' start-up)")
  p.add_argument("--alone", action="store_true",
                 help="run in a session of its own whose scheduling group is at nice -20 "
                 "(Linux autogroups; needs root or CAP_SYS_NICE): other sessions' jobs then "
                 "get a few percent of the CPU, as if the machine were free")
  p.add_argument("--json", help="also write every run here")
  p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    data, workers, rows, warmup, *steady = args.child
    print(json.dumps(child(data, int(workers), int(rows), int(warmup), steady == ["steady"])))
    return 0
  if args.alone:
    print(alone(), file=sys.stderr)
  start = time.perf_counter()
  data, mixture = Path(args.data).resolve(), Path(args.mixture).resolve()
  make_data(data, mixture=False)
  make_data(mixture, mixture=True)
  load = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="ceiling_bars_") as tmp:
    trees = {"this tree": ROOT}
    if args.baseline != "none":
      trees[args.baseline] = Path(tmp, "baseline")
      subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                      str(trees[args.baseline]), args.baseline], check=True, capture_output=True)
    runs: dict[tuple[str, str, int], list[dict]] = {}
    try:
      for r in range(args.rounds):
        flip = -1 if r % 2 else 1
        order = list(trees.items())[::flip]
        plan = [("ceiling", name, 2, lambda t=t: ceiling(t, data, args.ceiling_rows))
                for name, t in order[:2]] if r < 2 else []
        for w in (0, 2)[::flip]:
          for name, t in order:
            if name == "this tree" or w == 0:
              plan.append(("bench data", name, w, lambda t=t, w=w: pipeline(
                  t, data, w, args.rows, args.warmup)))
          plan.append(("mixture", "this tree", w, lambda w=w: pipeline(
              ROOT, mixture, w, args.mixture_rows, args.warmup)))
          if args.steady and w:
            plan.append(("bench data, workers up", "this tree", w, lambda w=w: pipeline(
                ROOT, data, w, args.rows, args.warmup, steady=True)))
        for kind, name, w, measure in plan:
          got = measure()
          runs.setdefault((kind, name, w), []).append(got)
          cpu_ms = got.get("main_cpu_ms_per_row") or got["main_cpu_s_per_row"] * 1e3
          print(f"[{time.perf_counter() - start:5.0f} s] round {r + 1}: {kind}, {name}, "
                f"{w} workers: {got['rows']} rows, {got['rows_per_s']:.1f} rows/s, main "
                f"{cpu_ms:.1f} ms CPU/row", file=sys.stderr)
    finally:
      if args.baseline != "none":
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(trees[args.baseline])], check=False, capture_output=True)
  print(report(runs, args, load, os.getloadavg(), time.perf_counter() - start))
  if args.json:
    Path(args.json).write_text(json.dumps({f"{k[0]}|{k[1]}|{k[2]}": v
                                           for k, v in runs.items()}, indent=1))
  return 0


def alone() -> str:
  """Moves this process into a session of its own (a new autogroup) at nice -20; its
  children inherit it. Says what it did."""
  try:
    if os.getsid(0) != os.getpid():
      os.setsid()
    with open("/proc/self/autogroup", "w", encoding="ascii") as f:
      f.write("-20")
    with open("/proc/self/autogroup", encoding="ascii") as f:
      return f"--alone: {f.read().strip()}"
  except OSError as e:
    return f"--alone not applied ({e}): other jobs share the CPU"


def report(runs, args, load_before, load_after, seconds) -> str:
  lines = [f"ceiling bars: medians over rounds; load average {load_before[0]:.1f} before, "
           f"{load_after[0]:.1f} after; {seconds:.0f} s", "",
           "| bar | goal | tree | figure |", "|---|---|---|---|"]
  for (kind, name, w), got in runs.items():
    if kind != "ceiling":
      continue
    parts = {k: _median(got, "cpu_s_per_row_by_thread", k) * 1e3
             for k in got[0]["cpu_s_per_row_by_thread"]}
    lines.append(f"| simulated ceiling: main CPU per row | <= 4 ms | {name} | "
                 f"{_median(got, 'main_cpu_s_per_row') * 1e3:.2f} ms ("
                 + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + ") |")
    lines.append(f"| simulated ceiling: rows/s, packed tokens/s | >= 250 rows/s | {name} | "
                 f"{_median(got, 'ceiling_rows_per_s'):.0f} rows/s, "
                 f"{_median(got, 'ceiling_tokens_per_s') / 1e6:.2f} M tokens/s |")
  for kind, rows in (("bench data", args.rows), ("mixture", args.mixture_rows)):
    two = runs.get((kind, "this tree", 2))
    zero = runs.get((kind, "this tree", 0))
    if not (two and zero):
      continue
    parts = {k: _median(two, "parts_ms_per_row", k) for k in two[0]["parts_ms_per_row"]}
    lines.append(f"| {kind}, 2 workers: main CPU per row | <= 4 ms | this tree | "
                 f"{_median(two, 'main_cpu_ms_per_row'):.1f} ms ("
                 + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ") |")
    ratio = _median(two, "rows_per_s") / _median(zero, "rows_per_s")
    cpu = ""
    if "cores" in two[0]:  # the CPU of every process of the runs, and who else ran
      cpu = (f"; CPU per row, all processes, {_median(two, 'cpu_ms_per_row'):.0f} / "
             f"{_median(zero, 'cpu_ms_per_row'):.0f} ms; cores used {_median(two, 'cores'):.2f}"
             f" / {_median(zero, 'cores'):.2f}, other jobs {_median(two, 'other_cores'):.2f} / "
             f"{_median(zero, 'other_cores'):.2f}; decoded in the main process at 2 workers "
             f"{_median(two, 'decoded_in_main'):.0f} samples")
    lines.append(f"| {kind}: 2 workers / 0 workers ({rows} rows) | >= 1.7x | this tree | "
                 f"{ratio:.2f}x ({_median(two, 'rows_per_s'):.2f} / "
                 f"{_median(zero, 'rows_per_s'):.2f} rows/s{cpu}) |")
    up = runs.get((f"{kind}, workers up", "this tree", 2))
    if up:
      lines.append(f"| {kind}: 2 workers after they are up / 0 workers ({rows} rows) | - | "
                   f"this tree | {_median(up, 'rows_per_s') / _median(zero, 'rows_per_s'):.2f}x"
                   f" ({_median(up, 'rows_per_s'):.2f} / {_median(zero, 'rows_per_s'):.2f} "
                   f"rows/s; {_median(up, 'cpu_ms_per_row'):.0f} ms CPU per row; cores used "
                   f"{_median(up, 'cores'):.2f}, other jobs {_median(up, 'other_cores'):.2f})"
                   " |")
    for w, got in ((0, zero), (2, two)):
      lines.append(f"| {kind}, {w} workers: peak memory, MiB | <= 700 per process | this tree "
                   f"| {_memory(got)} |")
  for (kind, name, w), got in runs.items():
    if kind == "bench data" and name != "this tree":
      ours = _median(runs[(kind, "this tree", 0)], "rows_per_s")
      theirs = _median(got, "rows_per_s")
      lines.append(f"| bench data, 0 workers: this tree / {name} | >= 1.0x | both | "
                   f"{ours / theirs:.2f}x ({ours:.2f} / {theirs:.2f} rows/s; {name}: "
                   f"{_memory(got)}) |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
