"""Scale of the Beam pipelines: `index`, `convert` and `audit --sample` on a synthetic corpus.

Writes a corpus of N T2I parquet shards (one row group of 4 rows each, tiny PNGs)
and one text-only VLM JSONL file of M lines, then times each command as a user
runs it (a fresh `bagel-grain` process each): in process, and with the
DirectRunner in multi-processing mode at 1 and 2 workers. A sampler follows the
process tree and reports the peak RSS of the launching process and of each Beam
worker, and the CPU seconds of all of them (on a busy machine the CPU seconds per
record are the figure that carries over, not the wall time). Run it from the Beam venv, on a quiet machine (it prints `uptime` before
and after each case, since other jobs on the machine skew every figure):

    .venv-beam/bin/python tools/beam_scale.py --shards 2000 --lines 2000000 --out out/beam_scale.json
    .venv-beam/bin/python tools/beam_scale.py --shards 500 --lines 200000 --skip convert
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

from bagel_grain.tooling.demo_data import write_tokenizer

ROWS = 4
MULTI = ["--direct_running_mode", "multi_processing"]


def make_corpus(root: Path, shards: int, lines: int) -> Path:
  """The corpus and its config; returns the config's path."""
  png = io.BytesIO()
  Image.new("RGB", (48, 32), (200, 100, 50)).save(png, "PNG")
  table = pa.table({"image": [png.getvalue()] * ROWS,
                    "captions": [json.dumps({"a": f"caption {i}"}) for i in range(ROWS)]})
  (root / "t2i").mkdir(parents=True)
  for s in range(shards):
    pq.write_table(table, root / "t2i" / f"part-{s:05d}.parquet")
  (root / "vlm").mkdir()
  line = ('{"conversations": [{"from": "human", "value": "What is %09d plus one?"}, '
          '{"from": "gpt", "value": "The next number."}]}\n')
  with open(root / "vlm" / "sft.jsonl", "w", encoding="utf-8") as f:
    for start in range(0, lines, 100_000):
      f.write("".join(line % i for i in range(start, min(lines, start + 100_000))))
  write_tokenizer(root / "tokenizer")
  config = {
      "tokenizer_path": str(root / "tokenizer"),
      "dataset_info": {"t2i_pretrain": {"t2i": {"data_dir": str(root / "t2i")}},
                       "vlm_sft": {"vlm": {"data_dir": str(root / "vlm"),
                                           "jsonl_path": str(root / "vlm" / "sft.jsonl")}}},
      "grouped_datasets": {
          "t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "is_mandatory": True,
                           "image_transform_args": {"image_stride": 16, "max_image_size": 64,
                                                    "min_image_size": 32}},
          "vlm_sft": {"dataset_names": ["vlm"], "weight": 1, "shuffle_lines": True,
                      "shuffle_seed": 0,
                      "image_transform_args": {"image_stride": 14, "max_image_size": 224,
                                               "min_image_size": 56}}},
      "expected_num_tokens": 1024, "max_num_tokens": 2048, "max_num_tokens_per_sample": 1024,
      "prefer_buffer_before": 512, "max_buffer_size": 4, "max_latent_size": 32}
  path = root / "config.yaml"
  path.write_text(yaml.safe_dump(config))
  return path


class PeakRss:
  """Peak RSS of a process and of each of its descendants, sampled every 0.1 s, and their
  CPU seconds (last sample: a process's final 0.1 s may be missed)."""

  def __init__(self, pid: int):
    self._root = psutil.Process(pid)
    self.peaks: dict[int, tuple[str, int]] = {}
    self.cpu: dict[int, float] = {}  # CPU seconds (user + system) of each process, last seen
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        procs = [self._root, *self._root.children(recursive=True)]
      except psutil.Error:
        break
      for p in procs:
        try:
          rss, cmd = p.memory_info().rss, " ".join(p.cmdline()[:3])
          times = p.cpu_times()
          self.cpu[p.pid] = times.user + times.system
        except psutil.Error:
          continue
        self.peaks[p.pid] = (cmd, max(rss, self.peaks.get(p.pid, ("", 0))[1]))
      self._stop.wait(0.1)

  def stop(self) -> dict:
    self._stop.set()
    self._thread.join()
    main = self.peaks.pop(self._root.pid, ("", 0))[1]
    workers = [rss for cmd, rss in self.peaks.values() if "sdk_worker" in cmd or "beam" in cmd]
    return {"cpu_s": sum(self.cpu.values()), "main_peak_mib": main / 2**20,
            "worker_peak_mib": max(workers, default=0) / 2**20, "workers_seen": len(workers)}


def run_case(name: str, args: list[str]) -> dict:
  load = os.getloadavg()
  start = time.perf_counter()
  process = subprocess.Popen([sys.executable, "-m", "bagel_grain.tooling.cli", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  rss = PeakRss(process.pid)
  out, err = process.communicate()
  wall = time.perf_counter() - start
  result = {"case": name, "wall_s": wall, **rss.stop(), "load_before": load,
            "load_after": os.getloadavg(), "rc": process.returncode}
  if process.returncode:
    result["error"] = err[-2000:]
  print(json.dumps(result), flush=True)
  return result


def _clear_index(root: Path) -> None:
  for p in [root / "t2i" / ".bagel_index.arrow", *root.glob("vlm/sft.jsonl.bagel_*")]:
    p.unlink(missing_ok=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shards", type=int, default=2000)
  parser.add_argument("--lines", type=int, default=2_000_000)
  parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--skip", nargs="*", default=[], choices=["index", "convert", "audit"])
  parser.add_argument("--split-bytes", type=int, default=16 << 20)
  parser.add_argument("--records-per-shard", type=int, default=65536)
  parser.add_argument("--out", default=None, help="a JSON file for the results")
  parser.add_argument("--work", default=None, help="a folder for the corpus (default: temp)")
  args = parser.parse_args()
  work = Path(args.work or tempfile.mkdtemp(prefix="beam-scale-"))
  start = time.perf_counter()
  config = make_corpus(work / "corpus", args.shards, args.lines)
  size = sum(p.stat().st_size for p in (work / "corpus").rglob("*") if p.is_file())
  print(f"corpus: {args.shards} shards + {args.lines:,} lines, {size / 2**20:.0f} MiB, written "
        f"in {time.perf_counter() - start:.0f} s; uptime {os.getloadavg()}", flush=True)
  results = []
  if "index" not in args.skip:
    results.append(run_case("index in process", ["index", str(config)]))
    for w in args.workers:
      _clear_index(work / "corpus")
      results.append(run_case(f"index DirectRunner {w} workers", [
          "index", str(config), "--split-bytes", str(args.split_bytes), "--runner",
          "DirectRunner", "--direct_num_workers", str(w), *MULTI]))
  if "convert" not in args.skip:
    common = ["--config", str(config), "--records-per-shard", str(args.records_per_shard)]
    results.append(run_case("convert in process", ["convert", *common, "--out",
                                                   str(work / "conv_in_process")]))
    for w in args.workers:
      results.append(run_case(f"convert DirectRunner {w} workers", [
          "convert", *common, "--out", str(work / f"conv_{w}"), "--runner", "DirectRunner",
          "--direct_num_workers", str(w), *MULTI]))
  if "audit" not in args.skip:
    results.append(run_case("audit --sample 1000 in process", [
        "audit", "--config", str(config), "--sample", "1000", "--out", str(work / "audit")]))
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"shards": args.shards, "lines": args.lines,
                                          "corpus_mib": size / 2**20, "results": results},
                                         indent=1))
  if not args.work:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
