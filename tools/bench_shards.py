"""What logical shards cost: throughput and peak RSS per logical shard count, side by side.

Each setting runs in a fresh interpreter (so its peak RSS is its own), for
`--rounds` rounds in alternating order; the table shows medians over rounds of
the per-window medians, and each throughput and memory figure as a ratio to
`S = 1`. Throughput is given per wall second and per CPU second (the main
process and its workers): on a machine shared with other jobs the second is the
steadier measure of what the shards cost. Peak RSS adds the main process's and
each worker's. Settings: one process serving S = 1, 8, 64 logical shards, and
process 0 of 8 serving its 8 of 64.

    python tools/bench_shards.py --data .bench_data --workers 2 --seconds 20 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = (  # (label, logical shards, process count); this process is process 0
    ("S=1", 1, 1), ("S=8", 8, 1), ("S=64", 64, 1), ("S=64, P=8", 64, 8))


def measure(config: str | None, data: str, shards: int, processes: int, *, workers: int,
            batch_size: int, seconds: float, windows: int, warmup: int) -> dict:
  """One setting, in this process: throughput per window, peak RSS, state and buffers."""
  # pylint: disable=import-outside-toplevel
  import bagel_grain
  from bagel_grain.tooling.bench import _RssSampler  # pylint: disable=protected-access
  from bagel_grain.configs import load_shipped
  cfg = bagel_grain.load_config(config) if config else load_shipped("bench", data)
  cfg = dataclasses.replace(cfg, logical_shards=shards)
  tokenizer = bagel_grain.load_tokenizer(cfg.tokenizer_path)
  sampler = _RssSampler()
  start = time.perf_counter()
  it = iter(bagel_grain.build_pipeline(cfg, tokenizer, batch_size=batch_size, process_index=0,
                                       process_count=processes, workers=workers))
  try:
    next(it)
    first_batch_s = time.perf_counter() - start
    for _ in range(warmup):
      next(it)
    rates = []
    for _ in range(windows):
      before, t0, cpu0 = bagel_grain.pipeline_stats(it), time.perf_counter(), _cpu_seconds()
      while time.perf_counter() - t0 < seconds / windows:
        next(it)
      elapsed, cpu, after = time.perf_counter() - t0, _cpu_seconds() - cpu0, \
          bagel_grain.pipeline_stats(it)
      image_tokens = after["image_tokens"] - before["image_tokens"]
      rates.append(((after["tokens"] - before["tokens"]) / elapsed, image_tokens / elapsed,
                    image_tokens / cpu))
    state, stats = it.get_state(), bagel_grain.pipeline_stats(it)
  finally:
    it.close()
  sampler.stop()
  return {
      "packed_tokens_per_s": statistics.median(r[0] for r in rates),
      "image_tokens_per_s": statistics.median(r[1] for r in rates),
      "image_tokens_per_cpu_s": statistics.median(r[2] for r in rates),
      "first_batch_s": first_batch_s,
      "served_shards": len(state["shards"]),
      "state_bytes_per_shard": max(len(json.dumps(s)) for s in state["shards"].values()),
      "buffered": stats["buffered"],
      "peak_rss_main_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "peak_rss_worker_mib": sum(sampler.peak_children.values()) / 2**20,
  }


def _cpu_seconds() -> float:
  """CPU time (user + system) of this process and its live children (the workers)."""
  import psutil  # pylint: disable=import-outside-toplevel
  me = psutil.Process()
  total = sum(me.cpu_times()[:2])
  for child in me.children(recursive=True):
    try:
      total += sum(child.cpu_times()[:2])
    except psutil.Error:
      pass
  return total


def run_setting(args, shards: int, processes: int) -> dict:
  """`measure` in a fresh interpreter."""
  config = ["--config", args.config] if args.config else []
  cmd = [sys.executable, __file__, "--child", str(shards), str(processes), *config, "--data",
         args.data, "--workers", str(args.workers), "--batch-size", str(args.batch_size),
         "--seconds", str(args.seconds), "--windows", str(args.windows), "--warmup",
         str(args.warmup)]
  out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
  return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, list[dict]]) -> str:
  def median(label, key):
    return statistics.median(r[key] for r in results[label])

  base_tok = median("S=1", "image_tokens_per_s")
  base_cpu = median("S=1", "image_tokens_per_cpu_s")
  base_rss = max(r["peak_rss_main_mib"] + r["peak_rss_worker_mib"] for r in results["S=1"])
  lines = ["setting     shards  image tok/s  x S=1  image tok/CPU s  x S=1  peak RSS MiB "
           "(main+workers)  x S=1  buffered  state B/shard  first batch"]
  for label, runs in results.items():
    rss = max(r["peak_rss_main_mib"] + r["peak_rss_worker_mib"] for r in runs)
    tok, cpu = median(label, "image_tokens_per_s"), median(label, "image_tokens_per_cpu_s")
    lines.append(
        f"{label:10s}  {runs[0]['served_shards']:6d}  {tok:11,.0f}  {tok / base_tok:5.2f}  "
        f"{cpu:15,.0f}  {cpu / base_cpu:5.2f}  {rss:27,.0f}  {rss / base_rss:5.2f}  "
        f"{median(label, 'buffered'):8.0f}  {max(r['state_bytes_per_shard'] for r in runs):13d}"
        f"  {median(label, 'first_batch_s'):9.1f} s")
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", help="a config of yours (default: the shipped bench config)")
  parser.add_argument("--data", default=".bench_data", help="data of the shipped bench config")
  parser.add_argument("--workers", type=int, default=0)
  parser.add_argument("--batch-size", type=int, default=1)
  parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per setting")
  parser.add_argument("--windows", type=int, default=4)
  parser.add_argument("--warmup", type=int, default=2, help="batches before timing")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--json", help="also write the raw results here")
  parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(measure(args.config, args.data, *args.child, workers=args.workers,
                             batch_size=args.batch_size, seconds=args.seconds,
                             windows=args.windows, warmup=args.warmup)))
    return 0
  results: dict[str, list[dict]] = {label: [] for label, _, _ in SETTINGS}
  for r in range(args.rounds):
    order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]  # alternate: drift hits all alike
    for label, shards, processes in order:
      results[label].append(run_setting(args, shards, processes))
      print(f"round {r + 1}: {label} done", file=sys.stderr)
  print(f"workers={args.workers}, batch_size={args.batch_size}, {args.seconds:.0f} s per "
        f"setting, medians of {args.rounds} rounds")
  print(table(results))
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
