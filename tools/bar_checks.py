"""Two checks beside `ceiling_bars.py`, each alternating its variants in fresh interpreters.

  python tools/bar_checks.py zero --baseline a24d1ac --rounds 4   # 0 workers: this tree / baseline
  python tools/bar_checks.py pinned --rounds 3 --rows 80          # main alone on a core, or not

`zero`: the bench data at 0 workers, `--rows` rows after 3, this tree and the baseline
(a temporary `git worktree`) in turn: rows/s and CPU per row, the ratio per round. The
bars give that ratio two rounds; a 1% question needs more.

`pinned`: 2 workers on the bench data, timed once they are up, the main process's CPU per
row by part, with the main process alone on core 0 and its workers on core 1
(`sched_setaffinity`, set on the workers as they appear), against no pinning: whether the
main process's parts cost more in the real run than at the simulated ceiling because it
shares its cores with the workers. The pinning thread's own CPU shows as "other".
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

import ceiling_bars  # tools/, this script's folder

ROOT = Path(__file__).resolve().parents[1]


def _pin_workers_to(core: int) -> None:
  """Pins every child process (all its threads) to `core` as it appears, for a minute."""
  import psutil  # pylint: disable=import-outside-toplevel
  me, seen = psutil.Process(), set()
  for _ in range(1200):
    for kid in me.children(recursive=True):
      if kid.pid in seen:
        continue
      try:
        for thread in kid.threads():
          os.sched_setaffinity(thread.id, {core})
        seen.add(kid.pid)
      except (psutil.Error, OSError):
        pass
    time.sleep(0.05)


def _pinned_child(pin: bool, data: str, rows: int) -> dict:
  if pin:
    os.sched_setaffinity(0, {0})  # the workers spawned inherit it until they are pinned
    threading.Thread(target=_pin_workers_to, args=(1,), daemon=True).start()
  return ceiling_bars.child(data, 2, rows, 3, steady=True)


def _median(runs: list[dict], key: str) -> float:
  return statistics.median(r[key] for r in runs)


def zero(args) -> None:
  with tempfile.TemporaryDirectory(prefix="bar_checks_") as tmp:
    trees = {"this tree": ROOT, args.baseline: Path(tmp, "baseline")}
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                    str(trees[args.baseline]), args.baseline], check=True, capture_output=True)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
      for r in range(args.rounds):
        for name in list(trees)[::-1 if r % 2 else 1]:
          got = ceiling_bars.pipeline(trees[name], Path(args.data).resolve(), 0, args.rows, 3)
          runs[name].append(got)
          print(f"round {r + 1}, {name}: {got['rows_per_s']:.3f} rows/s, "
                f"{got['cpu_ms_per_row']:.1f} ms CPU per row", flush=True)
    finally:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                      str(trees[args.baseline])], check=False, capture_output=True)
  ratios = [t["rows_per_s"] / b["rows_per_s"] for t, b in zip(*runs.values())]
  for name, got in runs.items():
    print(f"{name}: median {_median(got, 'rows_per_s'):.3f} rows/s, "
          f"{_median(got, 'cpu_ms_per_row'):.1f} ms CPU per row")
  print(f"ratio per round {[round(x, 3) for x in ratios]}, median "
        f"{statistics.median(ratios):.3f}; load average {os.getloadavg()}")


def pinned(args) -> None:
  runs: dict[str, list[dict]] = {"pinned": [], "free": []}
  for r in range(args.rounds):
    for name in list(runs)[::-1 if r % 2 else 1]:
      done = subprocess.run([sys.executable, __file__, "child", name, args.data, str(args.rows)],
                            capture_output=True, text=True, check=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
      got = json.loads(done.stdout.strip().splitlines()[-1])
      runs[name].append(got)
      print(f"round {r + 1}, {name}: main {got['main_cpu_ms_per_row']:.2f} ms CPU per row",
            {k: round(v, 2) for k, v in got["parts_ms_per_row"].items()}, flush=True)
  for name, got in runs.items():
    parts = {k: round(statistics.median(g["parts_ms_per_row"][k] for g in got), 2)
             for k in got[0]["parts_ms_per_row"]}
    print(f"{name}: median main {_median(got, 'main_cpu_ms_per_row'):.2f} ms CPU per row", parts)
  print(f"load average {os.getloadavg()}")


def main() -> int:
  if sys.argv[1:2] == ["child"]:
    _, _, name, data, rows = sys.argv
    print(json.dumps(_pinned_child(name == "pinned", data, int(rows))))
    return 0
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("check", choices=["zero", "pinned"])
  p.add_argument("--data", default=".bench_data")
  p.add_argument("--baseline", default="a24d1ac")
  p.add_argument("--rounds", type=int, default=4)
  p.add_argument("--rows", type=int, default=120)
  args = p.parse_args()
  if len(os.sched_getaffinity(0)) < 2 and args.check == "pinned":
    p.error("pinned needs two cores")
  {"zero": zero, "pinned": pinned}[args.check](args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
