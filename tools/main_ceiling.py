"""The main process's ceiling: rows/s when samples arrive as fast as it can take them.

  python tools/main_ceiling.py --data .bench_data --workers 2 --rows 200

Builds the bench config's pipeline (batch size 1) with every group's samples replaced
by a replay: element i of a group is a copy of one of its first `--distinct`
samples (computed once per process, in a warm-up, then served from memory), with
its own key. The worker processes then do almost nothing but send, so the main
process (receiving, mixing, packing, writing rows, handing out batches) is the
only thing left to measure: a simulated host with as many workers as it takes.

It prints rows/s (wall), the main process's CPU seconds per row (all its threads,
`time.process_time`) and by thread, and the ceiling that CPU implies, 1 / (CPU s
per row), in rows/s and packed tokens/s. On a machine with fewer free cores than
processes the wall rate is bounded by the workers' share of the cores too; the CPU
per row is the figure that holds.

An element no worker has picked up yet the main process takes over, as always; here
it sleeps `--slow-here-s` (as slow as a decode, without its CPU), so that the
workers, niced on a busy machine, still serve most elements: the count of the ones
taken over is printed beside the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import grain

import bagel_grain
from bagel_grain.configs import load_shipped
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from bagel_grain.tooling.bench import _thread_cpu  # pylint: disable=protected-access
from bagel_grain.workers.fetcher import live


class Replay(grain.MapDataset):
  """Element i of `parent` is a copy of element i % `distinct`, keyed i: pre-decoded
  samples served at any rate (each distinct one computed once per process)."""

  def __init__(self, parent: grain.MapDataset, distinct: int, slow_here_s: float):
    super().__init__(parent)
    self._distinct = distinct
    self._cache: dict[int, object] = {}
    self._here, self._slow_here_s = os.getpid(), slow_here_s

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index: int):
    j = index % self._distinct
    if j not in self._cache:
      self._cache[j] = self._parent[j]
    element = self._cache[j]
    if os.getpid() == self._here:  # a take-over: as slow as a decode, without its CPU
      time.sleep(self._slow_here_s)
    if isinstance(element, PreparedSample):
      return dataclasses.replace(element, key=dataclasses.replace(element.key, index=index))
    return element

  def fill(self) -> None:
    """Computes every distinct element here (in the process that calls it)."""
    for j in range(min(self._distinct, len(self))):
      self._cache.setdefault(j, self._parent[j])

  def __getstate__(self):
    return {**self.__dict__, "_cache": {}}


def measure(data: str, workers: int, distinct: int, warmup: int, rows: int,
            slow_here_s: float) -> dict:
  cfg = load_shipped("bench", data)
  dataset = build_pipeline(cfg, bagel_grain.load_tokenizer(cfg.tokenizer_path), batch_size=1,
                           workers=workers)
  rows_stage, replays = dataset.parents[0], []
  make_fetcher = rows_stage._fetcher  # pylint: disable=protected-access

  def replaying(groups):
    replays.extend(Replay(g, distinct, slow_here_s) for g in groups)
    return make_fetcher(replays)

  rows_stage._fetcher = replaying  # pylint: disable=protected-access
  it = iter(dataset)
  try:
    for _ in range(warmup):  # each worker computes its distinct samples here
      next(it)
    for replay in replays:  # and this process, for the elements it takes over
      replay.fill()
    (fetcher,) = live()
    threads, start, inline = _thread_cpu(), pipeline_stats(it), fetcher.inline_elements
    parts = it.cpu_seconds() if hasattr(it, "cpu_seconds") else {}  # (older trees: none)
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = 0
    for _ in range(rows):
      tokens += int(next(it)["num_tokens"].sum())
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    threads = {k: v - threads[k] for k, v in _thread_cpu().items()}
    if parts:  # the caller's thread: row writing and hand-off apart from placement
      parts = {k: v - parts[k] for k, v in it.cpu_seconds().items()}
      threads["main"] -= sum(parts.values())
      threads = {"pump": threads.pop("pump"), "placement": threads.pop("main"), **parts,
                 **threads}
    done = pipeline_stats(it)["rows"] - start["rows"]
    inline = fetcher.inline_elements - inline
  finally:
    it.close()
  return {"code": bagel_grain.__file__, "workers": workers, "rows": done, "wall_s": wall,
          "cpu_s": cpu, "rows_per_s": done / wall, "main_cpu_s_per_row": cpu / done,
          "ceiling_rows_per_s": done / cpu, "tokens_per_row": tokens / done,
          "ceiling_tokens_per_s": tokens / cpu, "taken_over": inline,
          "cpu_s_per_row_by_thread": {k: v / done for k, v in threads.items()}}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--data", default=".bench_data")
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--distinct", type=int, default=16, help="distinct samples per group")
  p.add_argument("--warmup", type=int, default=30, help="rows before the timed ones")
  p.add_argument("--rows", type=int, default=200)
  p.add_argument("--slow-here-s", type=float, default=0.05,
                 help="seconds an element the main process takes over waits (no CPU)")
  p.add_argument("--json", help="also write the figures here")
  args = p.parse_args()
  got = measure(args.data, args.workers, args.distinct, args.warmup, args.rows,
                args.slow_here_s)
  by_thread = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in got["cpu_s_per_row_by_thread"].items())
  print(f"{got['workers']} workers serving replayed samples: {got['rows']} rows in "
        f"{got['wall_s']:.1f} s = {got['rows_per_s']:.1f} rows/s (wall)\n"
        f"main process: {got['main_cpu_s_per_row'] * 1e3:.2f} ms CPU per row ({by_thread}; "
        f"{got['taken_over']} samples it took over from the workers)\n"
        f"ceiling: {got['ceiling_rows_per_s']:.0f} rows/s, "
        f"{got['ceiling_tokens_per_s'] / 1e6:.2f} M packed tokens/s "
        f"({got['tokens_per_row']:,.0f} tokens per row)")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(got, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
