"""When a pipeline's workers come up, and what their start-up cost them in CPU.

  python tools/worker_startup.py --data .bench_data [--workers 2] [--rounds 3]

Each round a fresh interpreter builds the bench config's pipeline (batch size 1) and
iterates it until every worker is ready; per worker it prints the seconds since the
build began and the worker's own CPU seconds when it said hello (its imports done)
and when it was ready (its datasets unpickled), with the load average. Run it with
`PYTHONPATH` set to the tree to measure; alternate trees by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(data: str, workers: int) -> dict:
  # pylint: disable=import-outside-toplevel,protected-access
  import psutil
  import bagel_grain
  from bagel_grain.configs import load_shipped
  from bagel_grain.pipeline import build_pipeline
  from bagel_grain.workers import fetcher
  marks: dict[str, list] = {}
  starting = fetcher.Fetcher._starting

  def noted(self, w, message):
    cpu = psutil.Process(w.process.pid).cpu_times()
    marks.setdefault(message, []).append(
        (round(time.monotonic() - began, 3), round(cpu.user + cpu.system, 3)))
    return starting(self, w, message)
  fetcher.Fetcher._starting = noted
  cfg = load_shipped("bench", data)
  tokenizer = bagel_grain.load_tokenizer(cfg.tokenizer_path)
  began = time.monotonic()
  dataset = build_pipeline(cfg, tokenizer, batch_size=1, workers=workers)
  built = time.monotonic() - began
  it = iter(dataset)
  rows = 0
  try:
    while len(marks.get("ready", [])) < workers:
      next(it)
      rows += 1
  finally:
    it.close()
  return {"built_s": round(built, 3), "rows_before_up": rows, **marks}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--data", default=".bench_data")
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print(json.dumps(child(args.data, args.workers)))
    return 0
  for _ in range(args.rounds):
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, __file__, "--child", "--data", args.data,
                           "--workers", str(args.workers)], capture_output=True, text=True,
                          check=True)
    print(f"load {load:.2f} {done.stdout.strip().splitlines()[-1]}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
