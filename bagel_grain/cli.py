"""The `bagel-grain` command: make-sample-data, demo, inspect, make-bench-data, bench, convert."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np


def _make_sample_data(args) -> int:
  from bagel_grain.demo_data import make_sample_data  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  out = make_sample_data(args.dir)
  print(f"wrote demo data to {out} in {time.perf_counter() - start:.1f} s")
  return 0


def _demo(args) -> int:
  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm

  from bagel_grain.config import load_config
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.tokenizer import load_tokenizer

  cfg = load_config(args.config)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  ds = build_pipeline(cfg, tokenizer, batch_size=args.batch_size, workers=args.workers)
  it = iter(ds)
  fills, shares = [], collections.Counter()
  text_tokens = vit_tokens = vae_tokens = 0
  start = time.perf_counter()
  first = None
  try:
    for _ in tqdm(range(args.batches), desc="packing", unit="batch", file=sys.stdout):
      batch = next(it)
      first = first or time.perf_counter() - start
      L = batch["text_ids"].shape[1]
      fills.extend((batch["num_tokens"] / L).tolist())
      vit_tokens += int(batch["num_vit_tokens"].sum())
      vae_tokens += int(batch["num_vae_tokens"].sum())
      text_tokens += int((batch["token_type"] == 1).sum())
      for keys in batch["sample_keys"]:
        shares.update(k[0] for k in keys)
    elapsed = time.perf_counter() - start
    stats = pipeline_stats(it)
    state = json.dumps(it.get_state())
  finally:
    it.close()

  rows = len(fills)
  print(f"\n{rows} rows of L={L} in {elapsed:.1f} s ({rows / elapsed:.2f} rows/s); "
        f"first batch {first:.2f} s")
  print(f"fill (real tokens / L): mean {np.mean(fills):.3f}, min {np.min(fills):.3f}, "
        f"max {np.max(fills):.3f}")
  print(f"tokens/s: {(text_tokens + vit_tokens + vae_tokens) / elapsed:,.0f} "
        f"(text {text_tokens:,}, ViT {vit_tokens:,}, VAE {vae_tokens:,})")
  weights = {g.name: g.weight for g in cfg.groups}
  total_w, total_s = sum(weights.values()), sum(shares.values())
  print("\ngroup            weight share  sample share  samples/s  dropped  epoch")
  for name, w in weights.items():
    n = shares[name]
    dropped = sum(stats["drops"][name].values())
    print(f"{name:16s} {w / total_w:12.3f}  {n / total_s:12.3f}  {n / elapsed:9.1f}  "
          f"{dropped:7d}  {stats['epoch'][name]:5d}")
  print("\ndrops by reason:", dict(stats["drops_by_reason"]) or "none")
  notes = {g: dict(n) for g, n in stats["notes"].items() if n}
  print("notes:", notes or "none")
  print(f"rows missing a mandatory group (its sample carried): "
        f"{dict(stats['missing_mandatory']) or 'none'}")
  print(f"accounting: drawn {stats['drawn']} = packed {stats['packed']} + dropped "
        f"{stats['dropped']} + buffered {stats['buffered']} + carried {stats['carried']}")
  print(f"iterator state: {len(state)} bytes of JSON")
  return 0


def _make_bench_data(args) -> int:
  from bagel_grain.bench_data import make_bench_data  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  out = make_bench_data(args.dir, t2i_rows=args.t2i_rows, edit_rows=args.edit_rows,
                        vlm_rows=args.vlm_rows)
  print(f"wrote benchmark data to {out} in {time.perf_counter() - start:.1f} s")
  return 0


def _bench(args) -> int:
  # pylint: disable=import-outside-toplevel
  from bagel_grain import bench
  from bagel_grain.config import load_config
  from bagel_grain.tokenizer import load_tokenizer

  cfg = load_config(args.config)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  report = bench.run_bench(cfg, tokenizer, workers=args.workers, seconds=args.seconds,
                           windows=args.windows, batch_size=args.batch_size)
  print(bench.format_table(report))
  for path in (args.json, args.plot):
    if path:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=float)
  if args.plot:
    bench.plot(report, args.plot)
  return 0


def _inspect(args) -> int:
  from bagel_grain.inspect_row import inspect_pipeline_row  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  print(inspect_pipeline_row(args.config, args.out, index=args.index, seed=args.seed))
  print(f"wrote {args.out}")
  return 0


def _convert(args) -> int:
  from bagel_grain.convert import convert_config_file  # pylint: disable=import-outside-toplevel
  done = convert_config_file(args.config, args.out, records_per_shard=args.records_per_shard,
                             overwrite=args.overwrite, num_threads=args.threads)
  for d in done.datasets:
    print(f"{d.group}/{d.name}: {d.num_records} records in {len(d.files)} ArrayRecord files")
  print(f"wrote {done.dataset_info}\nuse it with: --config {done.config}")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="bagel-grain", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("make-sample-data", help="write the embedded demo dataset")
  p.add_argument("dir", nargs="?", default=".demo_data")
  p.set_defaults(run=_make_sample_data)
  p = sub.add_parser("demo", help="pack the demo data and report fill, shares and drops")
  p.add_argument("--config", default="configs/demo.yaml")
  p.add_argument("--batches", type=int, default=30)
  p.add_argument("--batch-size", type=int, default=None,
                 help="rows per batch (default: the config's batch_size)")
  p.add_argument("--workers", type=int, default=None)
  p.set_defaults(run=_demo)
  p = sub.add_parser("inspect", help="draw one packed row (bands, mask, images) as a PNG")
  p.add_argument("--config", default="configs/demo.yaml")
  p.add_argument("--out", default="out/row.png")
  p.add_argument("--index", type=int, default=0, help="which packed row of the stream")
  p.add_argument("--seed", type=int, default=None)
  p.set_defaults(run=_inspect)
  p = sub.add_parser("make-bench-data", help="write the benchmark dataset (real photographs)")
  p.add_argument("dir", nargs="?", default=".bench_data")
  p.add_argument("--t2i-rows", type=int, default=800)
  p.add_argument("--edit-rows", type=int, default=200)
  p.add_argument("--vlm-rows", type=int, default=400)
  p.set_defaults(run=_make_bench_data)
  p = sub.add_parser("bench", help="throughput, latency, state and memory against the floor")
  p.add_argument("--config", default="configs/bench.yaml")
  p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--seconds", type=float, default=30.0, help="timed seconds per worker count")
  p.add_argument("--windows", type=int, default=5)
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--json", help="write the full report here")
  p.add_argument("--plot", help="write a PNG of throughput against worker count")
  p.set_defaults(run=_bench)
  p = sub.add_parser("convert", help="convert a config's parquet/JSONL data to ArrayRecord")
  p.add_argument("--config", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--records-per-shard", type=int, default=4096)
  p.add_argument("--overwrite", action="store_true")
  p.add_argument("--threads", type=int, default=16)
  p.set_defaults(run=_convert)
  args = parser.parse_args(argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
