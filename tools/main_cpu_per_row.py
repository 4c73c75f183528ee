"""The main process's CPU seconds per row, code tree against code tree, runs alternating.

  python tools/main_cpu_per_row.py --tree before=/tmp/old_checkout --tree after=. \\
      --workers 0 2 --rounds 3

Each measurement is a fresh interpreter with PYTHONPATH set to the tree: the bench
config on `--data` (what `make bench` writes), batch size 1, `--warmup` batches, then
batches until `--rows` rows or `--seconds` seconds. It prints, per tree and worker
count, the median over rounds of the main process's CPU seconds per row
(`time.process_time`: all its threads), its share of one core, and the rows/s that
implies. CPU time, so a busy machine changes the figures less than wall time;
rounds alternate the trees so that a change of load meets both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(data: str, workers: int, warmup: int, rows: int, seconds: float) -> None:
  # pylint: disable=import-outside-toplevel
  import bagel_grain
  from bagel_grain.configs import load_shipped
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  cfg = load_shipped("bench", data)
  tokenizer = bagel_grain.load_tokenizer(cfg.tokenizer_path)
  it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=workers))
  try:
    for _ in range(warmup):
      batch = next(it)
    cpu, wall, start = time.process_time(), time.perf_counter(), pipeline_stats(it)["rows"]
    while True:
      batch = next(it)
      done = pipeline_stats(it)["rows"] - start
      if done >= rows or time.perf_counter() - wall >= seconds:
        break
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
  finally:
    it.close()
  del batch
  print(json.dumps({"code": bagel_grain.__file__, "rows": done, "cpu_s": cpu, "wall_s": wall}))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                 help="a code tree to measure (repeat); its bagel_grain is imported")
  p.add_argument("--data", default=".bench_data")
  p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--rows", type=int, default=40)
  p.add_argument("--seconds", type=float, default=30.0)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    _child(args.data, args.workers[0], args.warmup, args.rows, args.seconds)
    return 0
  trees = dict(t.split("=", 1) for t in args.tree)
  results: dict[tuple[str, int], list[dict]] = {}
  for r in range(args.rounds):
    order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
    for workers in args.workers:
      for name, path in order:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", "--tree", "x=.",
             "--data", os.path.abspath(args.data), "--workers", str(workers),
             "--warmup", str(args.warmup), "--rows", str(args.rows),
             "--seconds", str(args.seconds)],
            env=env, cwd=os.path.abspath(path), check=True, capture_output=True, text=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        results.setdefault((name, workers), []).append(got)
        print(f"round {r + 1}: {name}, {workers} workers: {got['rows']} rows, "
              f"{got['cpu_s'] / got['rows']:.4f} CPU s/row, "
              f"{got['cpu_s'] / got['wall_s']:.0%} of a core ({got['code']})", file=sys.stderr)
  print("tree     workers  main CPU s/row  busy (of 1 core)  rows/s implied  (median of "
        f"{args.rounds} rounds)")
  for (name, workers), runs in results.items():
    per_row = statistics.median(g["cpu_s"] / g["rows"] for g in runs)
    share = statistics.median(g["cpu_s"] / g["wall_s"] for g in runs)
    print(f"{name:8s} {workers:7d}  {per_row:14.4f}  {share:16.0%}  {1 / per_row:14.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
