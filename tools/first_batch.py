"""First-batch and restore latency for several worker counts, side by side.

Each measurement runs in a fresh process (imports done before the clock starts):
build the pipeline and take the first batch; then restore a state saved after a
few batches into a new iterator and take its first batch. Worker counts take
turns, `--repeats` times, and the medians are printed with their difference to
0 workers.

    python tools/first_batch.py --config bench --data .bench_data
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
from bagel_grain.config import load_config
from bagel_grain.configs import DATA_MAKERS, load_shipped
from bagel_grain.pipeline import build_pipeline
from bagel_grain.tokenizer import load_tokenizer

config, data, workers, batch_size, batches = sys.argv[1:6]
workers, batch_size, batches = int(workers), int(batch_size), int(batches)
cfg = load_shipped(config, data) if config in DATA_MAKERS else load_config(config)
tokenizer = load_tokenizer(cfg.tokenizer_path)
start = time.perf_counter()
it = iter(build_pipeline(cfg, tokenizer, batch_size=batch_size, workers=workers))
next(it)
first = time.perf_counter() - start
for _ in range(batches):
  next(it)
state = json.loads(json.dumps(it.get_state()))
it.close()
start = time.perf_counter()
restored = iter(build_pipeline(cfg, tokenizer, batch_size=batch_size, workers=workers))
restored.set_state(state)
next(restored)
restore = time.perf_counter() - start
restored.close()
print(json.dumps({"first_batch_s": first, "restore_s": restore}))
"""


def measure(args, workers: int) -> dict[str, float]:
  out = subprocess.run([sys.executable, "-c", _CHILD, args.config, args.data, str(workers),
                        str(args.batch_size), str(args.batches)],
                       capture_output=True, text=True, timeout=600, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="bench",
                      help="a shipped config's name (bench, demo) or a config file")
  parser.add_argument("--data", default=str(ROOT / ".bench_data"),
                      help="the data folder of a shipped config")
  parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch-size", type=int, default=1)
  parser.add_argument("--batches", type=int, default=3, help="taken before the state is saved")
  args = parser.parse_args(argv)
  runs: dict[int, list[dict[str, float]]] = {w: [] for w in args.workers}
  for _ in range(args.repeats):
    for w in args.workers:
      runs[w].append(measure(args, w))
  medians = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
  base = medians.get(0)
  for w, m in medians.items():
    delta = "" if base is None else "  (vs 0 workers: " + ", ".join(
        f"{k} {m[k] - base[k]:+.2f} s" for k in m) + ")"
    print(f"workers {w}: first batch {m['first_batch_s']:.2f} s, restore "
          f"{m['restore_s']:.2f} s{delta}")
  print(json.dumps({str(w): {"median": m, "runs": runs[w]} for w, m in medians.items()}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
