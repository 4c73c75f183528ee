"""The main process's CPU seconds per row, code tree against code tree, runs alternating.

  python tools/main_cpu_per_row.py --tree before=/tmp/old_checkout --tree after=. \\
      --workers 0 2 --rounds 3

Each measurement is a fresh interpreter with PYTHONPATH set to the tree: the bench
config on `--data` (what `make bench` writes), batch size 1, `--warmup` batches, then
batches until `--rows` rows or `--seconds` seconds. It prints, per tree and worker
count, the median over rounds of the main process's CPU seconds per row
(`time.process_time`: all its threads), its share of one core, the rows/s that
implies, and the CPU per row of its threads by kind (psutil): the caller's thread
(packing, batching), the fetcher's pump (receiving from the workers), decoding in
the main process (what no worker had picked up), the rest. CPU time, so a busy machine changes the figures less than wall time;
rounds alternate the trees so that a change of load meets both. On a loaded
machine the workers (niced) fall behind and the main process decodes what they
have not picked up: `bagel-grain bench` reports that part separately.

  python tools/main_cpu_per_row.py --writes 20 --rounds 3

measures the batching stage's writing alone, in this tree: `--writes` rows of the
bench stream laid out once, then written row after row into fresh batches
(`empty_row`, the code before batch buffers) and into the reused buffers
(`packing.buffers`), alternating; CPU seconds per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _thread_cpu() -> dict[str, float]:
  """CPU seconds so far of this process's threads, by kind: the caller's thread, the
  fetcher's pump (receives from workers), its inline thread (decodes what no worker
  has picked up), and the rest (read-ahead, Grain, the interpreter's)."""
  # pylint: disable=import-outside-toplevel
  import threading
  import psutil
  kinds = {"bagel-grain-fetch": "pump", "bagel-grain-inline": "decoding in main"}
  names = {t.native_id: t.name for t in threading.enumerate()}
  out = dict.fromkeys(("main thread", "pump", "decoding in main", "other"), 0.0)
  for t in psutil.Process().threads():
    name = names.get(t.id, "")
    kind = "main thread" if name == "MainThread" else kinds.get(name, "other")
    out[kind] += t.user_time + t.system_time
  return out


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
    threads = _thread_cpu()
    cpu, wall, start = time.process_time(), time.perf_counter(), pipeline_stats(it)["rows"]
    while True:
      batch = next(it)
      done = pipeline_stats(it)["rows"] - start
      if done >= rows or time.perf_counter() - wall >= seconds:
        break
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    threads = {k: v - threads[k] for k, v in _thread_cpu().items()}
  finally:
    it.close()
  del batch
  print(json.dumps({"code": bagel_grain.__file__, "rows": done, "cpu_s": cpu, "wall_s": wall,
                    "threads": threads}))


def _writes(data: str, count: int, rounds: int) -> None:
  # pylint: disable=import-outside-toplevel,protected-access
  import bagel_grain
  from bagel_grain.configs import load_shipped
  from bagel_grain.packing.buffers import BatchBuffers
  from bagel_grain.packing.row import batch_row, empty_row, write_row
  from bagel_grain.pipeline import build_pipeline, capacities
  cfg = load_shipped("bench", data)
  it = iter(build_pipeline(cfg, bagel_grain.load_tokenizer(cfg.tokenizer_path), batch_size=1))
  try:
    rows = [[s.layout for s in next(it._rows)] for _ in range(count)]  # the rows it would write
  finally:
    it.close()
  caps = capacities(cfg)

  def fresh():
    for layouts in rows:
      batch = empty_row(caps, (1,))
      write_row(batch_row(batch, 0), layouts)

  def reused(pool=BatchBuffers(caps, 1)):
    batch = None  # held while the next is written, as a training loop holds its batch
    for layouts in rows:
      buffer = pool.take()
      buffer.extents[0] = write_row(batch_row(buffer.arrays, 0), layouts,
                                    previous=buffer.extents[0])
      batch = pool.hand_out(buffer)
    del batch

  reused()  # the pool's buffers touched once, as after a pipeline's first batches
  seconds: dict[str, list[float]] = {"fresh batches": [], "reused buffers": []}
  for r in range(rounds):
    for name, write in (list(zip(seconds, (fresh, reused))))[::1 if r % 2 == 0 else -1]:
      cpu = time.process_time()
      write()
      seconds[name].append((time.process_time() - cpu) / count)
  for name, values in seconds.items():
    print(f"{name}: {statistics.median(values) * 1e3:.1f} ms CPU per row written "
          f"(median of {rounds} rounds of {count} rows; rounds: "
          f"{', '.join(f'{v * 1e3:.1f}' for v in values)})")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tree", action="append", metavar="NAME=PATH",
                 help="a code tree to measure (repeat); its bagel_grain is imported")
  p.add_argument("--data", default=".bench_data")
  p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--rows", type=int, default=40)
  p.add_argument("--seconds", type=float, default=30.0)
  p.add_argument("--writes", type=int, metavar="ROWS",
                 help="measure the row writing alone, fresh against reused, on ROWS rows")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.writes:
    _writes(args.data, args.writes, args.rounds)
    return 0
  if not args.tree:
    p.error("give --tree NAME=PATH (at least one) or --writes ROWS")
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
  kinds = list(next(iter(results.values()))[0]["threads"])
  print(f"medians of {args.rounds} rounds; CPU ms per row, by thread: "
        + ", ".join(kinds))
  print("tree     workers  main CPU s/row  busy (of 1 core)  rows/s implied  "
        + "  ".join(f"{k:>16s}" for k in kinds))
  for (name, workers), runs in results.items():
    per_row = statistics.median(g["cpu_s"] / g["rows"] for g in runs)
    share = statistics.median(g["cpu_s"] / g["wall_s"] for g in runs)
    by_thread = [statistics.median(g["threads"][k] / g["rows"] for g in runs) for k in kinds]
    print(f"{name:8s} {workers:7d}  {per_row:14.4f}  {share:16.0%}  {1 / per_row:14.1f}  "
          + "  ".join(f"{v * 1e3:16.1f}" for v in by_thread))
  return 0


if __name__ == "__main__":
  sys.exit(main())
