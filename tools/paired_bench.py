"""This tree against an older commit, on the same data and config, in alternating runs.

Wall-clock figures on a shared machine drift with the load; running the two trees
one after the other, round after round (the order flipping each round), lets the
drift hit both alike, and the medians over rounds compare them. The older commit
is checked out with `git worktree` in a temporary folder (removed at the end);
each run is a fresh interpreter of this venv with `PYTHONPATH` set to its tree, so
its peak RSS is its own. The run itself is a small driver that works on either
tree: the bench config of that tree (`bagel_grain/configs/bench.yaml`, or
`configs/bench.yaml` before it moved) pointed at `--data`, and that tree's
`measure_pipeline` (`bagel_grain.tooling.bench`, or `bagel_grain.bench`). Peak RSS is
given per process (main, and each worker), CPU seconds per image token for the
main process and the workers together.

    python tools/paired_bench.py --data .bench_data --commit 3ca4c2f --workers 0 2 --rounds 3

With `--floor`, the 0-worker runs also measure the decode+resize floor on their own
samples (the bench's `measure_floor`), so each tree's ratio to its floor is given.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
TREES = ("old", "new")
BENCH_CONFIGS = ("bagel_grain/configs/bench.yaml", "configs/bench.yaml")  # newest first
BENCH_MODULES = ("bagel_grain.tooling.bench", "bagel_grain.bench")
FIGURES = ("packed_tokens_per_s", "image_tokens_per_s", "first_batch_s", "restore_s",
           "peak_rss_main_mib", "peak_rss_worker_mib", "cpu_s_per_mtoken", "floor_ratio")


def schedule(rounds: int, workers: Sequence[int]) -> list[tuple[int, int, str]]:
  """(round, workers, tree) in run order: every worker count each round, the trees
  alternating within it and their order flipped from one round to the next."""
  runs = []
  for r in range(rounds):
    for w in workers:
      trees = TREES if (r + w) % 2 == 0 else TREES[::-1]
      runs.extend((r, w, tree) for tree in trees)
  return runs


def pointed_config(raw: dict[str, Any], data: str) -> dict[str, Any]:
  """A bench config's mapping with its data paths made absolute under `data`."""
  data = os.path.abspath(data)
  return {**raw, "tokenizer_path": os.path.join(data, "tokenizer"),
          "dataset_info": os.path.join(data, "dataset_info.yaml")}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
  """Per worker count and tree, the median of each figure over rounds; and per worker
  count the ratio new / old of each median. A run's `peak_rss_worker_mib` is its
  largest worker's."""
  by: dict[tuple[int, str], list[dict]] = {}
  for run in runs:
    by.setdefault((run["workers"], run["tree"]), []).append(run)
  out: dict[str, dict[str, dict[str, float]]] = {}
  for (w, tree), group in sorted(by.items()):
    medians = {}
    for figure in FIGURES:
      values = [g[figure] for g in group if g.get(figure) is not None]
      if values:
        medians[figure] = statistics.median(values)
    medians["rounds"] = len(group)
    out.setdefault(str(w), {})[tree] = medians
  for per_tree in out.values():
    if len(per_tree) == len(TREES):
      old, new = per_tree["old"], per_tree["new"]
      per_tree["new/old"] = {f: new[f] / old[f] for f in FIGURES
                             if f in old and f in new and old[f]}
  return out


def scaling(summary: dict[str, dict[str, dict[str, float]]], workers: int,
            figure: str = "packed_tokens_per_s") -> dict[str, float]:
  """Per tree, the rate with `workers` workers over the rate with none."""
  base, more = summary.get("0", {}), summary.get(str(workers), {})
  return {tree: more[tree][figure] / base[tree][figure] for tree in TREES
          if tree in base and tree in more and base[tree].get(figure)}


def format_summary(summary, commit: str) -> str:
  lines = [f"old = {commit}, new = this tree; medians over rounds",
           "workers  tree     packed tok/s  image tok/s  first batch  restore  RSS main  "
           "RSS worker  CPU s/Mtok  x floor"]
  for w, per_tree in summary.items():
    for tree in (*TREES, "new/old"):
      m = per_tree.get(tree)
      if m is None:
        continue
      if tree == "new/old":
        cells = [f"{m[f]:.2f}x" if f in m else "-" for f in FIGURES]
      else:
        cells = [f"{m['packed_tokens_per_s']:,.0f}", f"{m['image_tokens_per_s']:,.0f}",
                 f"{m['first_batch_s']:.2f} s", f"{m['restore_s']:.2f} s",
                 f"{m['peak_rss_main_mib']:,.0f}", f"{m.get('peak_rss_worker_mib', 0):,.0f}",
                 f"{m['cpu_s_per_mtoken']:.2f}",
                 f"{m['floor_ratio']:.2f}" if "floor_ratio" in m else "-"]
      lines.append(f"{w:>7}  {tree:7s}  {cells[0]:>12}  {cells[1]:>11}  {cells[2]:>11}  "
                   f"{cells[3]:>7}  {cells[4]:>8}  {cells[5]:>10}  {cells[6]:>10}  {cells[7]:>7}")
  for w in summary:
    if w != "0":
      ratios = scaling(summary, int(w))
      lines.append(f"{w} workers / 0 workers (packed tok/s): " +
                   ", ".join(f"{tree} {ratio:.2f}x" for tree, ratio in ratios.items()))
  return "\n".join(lines)


class _PeakRss:
  """Peak RSS of each child process (the workers), sampled in a thread."""

  def __init__(self, interval: float = 0.1):
    import psutil  # pylint: disable=import-outside-toplevel
    self._me, self._stop, self._interval = psutil.Process(), threading.Event(), interval
    self._error = psutil.Error
    self.peaks: dict[int, int] = {}
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self._interval):
      for child in self._me.children(recursive=True):
        try:
          rss = child.memory_info().rss
        except self._error:
          continue
        self.peaks[child.pid] = max(self.peaks.get(child.pid, 0), rss)

  def stop(self) -> list[float]:
    self._stop.set()
    self._thread.join()
    return sorted(v / 2**20 for v in self.peaks.values())


def _cpu_seconds() -> float:
  """CPU seconds of this process and of its children, live or ended."""
  import psutil  # pylint: disable=import-outside-toplevel
  me = psutil.Process()
  total = sum(me.cpu_times()[:4])  # user, system, and those of ended children
  for child in me.children(recursive=True):
    try:
      total += sum(child.cpu_times()[:2])
    except psutil.Error:
      pass
  return total


def drive(tree: str, data: str, *, workers: int, seconds: float, windows: int,
          floor: bool) -> dict[str, Any]:
  """One run of the tree on `PYTHONPATH` (this interpreter's): its bench config on `data`."""
  import yaml  # pylint: disable=import-outside-toplevel
  import bagel_grain  # pylint: disable=import-outside-toplevel
  from bagel_grain.config import load_config  # pylint: disable=import-outside-toplevel
  from bagel_grain.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  if not Path(bagel_grain.__file__).resolve().is_relative_to(Path(tree).resolve()):
    raise RuntimeError(f"imported {bagel_grain.__file__}, not the tree {tree}")
  bench = next(_module(name) for name in BENCH_MODULES if _module(name) is not None)
  source = next(Path(tree, p) for p in BENCH_CONFIGS if Path(tree, p).is_file())
  raw = pointed_config(yaml.safe_load(source.read_text(encoding="utf-8")), data)
  with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    yaml.safe_dump(raw, f)
  try:
    cfg = load_config(f.name)
  finally:
    os.unlink(f.name)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  peaks = _PeakRss()
  cpu0 = _cpu_seconds()
  result = bench.measure_pipeline(cfg, tokenizer, workers=workers, batch_size=1,
                                  seconds=seconds, windows=windows)
  cpu = _cpu_seconds() - cpu0
  worker_peaks = peaks.stop()
  image_tokens = sum(r["image_tokens_per_s"] * r["seconds"] for r in result["windows"])
  out = {key: result[key] for key in ("packed_tokens_per_s", "image_tokens_per_s",
                                      "first_batch_s", "restore_s")}
  out.update(
      workers=workers,
      peak_rss_main_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      peak_rss_workers_mib=worker_peaks,
      peak_rss_worker_mib=max(worker_peaks) if worker_peaks else None,
      # The whole run's CPU (start-up, warm-up, restore included) per timed image token:
      # comparable between trees, not an absolute cost.
      cpu_s_per_mtoken=cpu / image_tokens * 1e6 if image_tokens else None)
  if floor:
    start = time.perf_counter()
    measured = bench.measure_floor(cfg, result["keys_by_window"], seed=cfg.data_seed)
    out["floor_image_tokens_per_s"] = measured["image_tokens_per_s"]
    out["floor_ratio"] = result["image_tokens_per_s"] / measured["image_tokens_per_s"]
    out["floor_s"] = time.perf_counter() - start
  return out


def _module(name: str):
  try:
    return importlib.import_module(name)
  except ImportError:
    return None


def run_one(tree: Path, args, workers: int) -> dict[str, Any]:
  """`drive` in a fresh interpreter of this venv, with the tree first on the path."""
  cmd = [sys.executable, str(Path(__file__).resolve()), "--drive", str(tree), "--data",
         os.path.abspath(args.data), "--workers", str(workers), "--seconds", str(args.seconds),
         "--windows", str(args.windows)] + (["--floor"] if args.floor and workers == 0 else [])
  env = {**os.environ, "PYTHONPATH": str(tree)}
  done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"the run of {tree} with {workers} workers failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--commit", default="3ca4c2f", help="the older tree (default 3ca4c2f)")
  parser.add_argument("--data", default=".bench_data",
                      help="what `bagel-grain make-bench-data` wrote")
  parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per run")
  parser.add_argument("--windows", type=int, default=5)
  parser.add_argument("--floor", action="store_true",
                      help="0-worker runs also measure their decode+resize floor")
  parser.add_argument("--json", help="also write every run and the summary here")
  parser.add_argument("--drive", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.drive:
    print(json.dumps(drive(args.drive, args.data, workers=args.workers[0],
                           seconds=args.seconds, windows=args.windows, floor=args.floor)))
    return 0
  with tempfile.TemporaryDirectory(prefix="paired_bench_") as tmp:
    old = Path(tmp, "old")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old),
                    args.commit], check=True, capture_output=True)
    trees, runs = {"old": old, "new": ROOT}, []
    try:
      for r, w, tree in schedule(args.rounds, args.workers):
        run = run_one(trees[tree], args, w)
        runs.append({**run, "tree": tree, "round": r})
        print(f"round {r + 1}, {w} workers, {tree}: {run['packed_tokens_per_s']:,.0f} packed "
              f"tok/s, RSS main {run['peak_rss_main_mib']:,.0f} MiB, workers "
              f"{[round(p) for p in run['peak_rss_workers_mib']]} MiB", file=sys.stderr)
    finally:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                     check=False, capture_output=True)
  summary = summarize(runs)
  print(format_summary(summary, args.commit))
  if args.json:
    Path(args.json).write_text(json.dumps({"commit": args.commit, "runs": runs,
                                           "summary": summary}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
