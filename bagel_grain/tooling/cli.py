"""The `bagel-grain` command: make-sample-data, demo, inspect, make-bench-data, bench, index, convert, audit, replay, ledger.

Results go to stdout, progress and errors to stderr. An error is one line naming
what failed (`--debug` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np


def _make_sample_data(args) -> int:
  # pylint: disable=import-outside-toplevel
  from bagel_grain.configs import load_shipped
  from bagel_grain.sources.sidecar import index_config
  from bagel_grain.tooling.demo_data import make_sample_data
  start = time.perf_counter()
  out = make_sample_data(args.dir)
  # The sidecar index, as a user would write it once per corpus: the demo's builds then
  # read no footer. Written here, not by `make_sample_data`, whose data the tests use
  # unindexed (the scans and footers a build reads without an index).
  index_config(load_shipped("demo", out), NoProgress)
  print(f"wrote demo data and its sidecar index to {out} in {time.perf_counter() - start:.1f} s")
  return 0


class NoProgress:
  """A progress bar that shows nothing (tqdm's interface, for `index_config`)."""

  def __init__(self, *args):
    del args

  def update(self, n: int = 1) -> None:
    del n

  def close(self) -> None:
    pass


def _config(args):
  """The config `--config` names, else the shipped one on the data in `--data`."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.config import load_config
  from bagel_grain.configs import load_shipped
  return load_config(args.config) if args.config else load_shipped(args.shipped, args.data)


def _demo(args) -> int:
  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm

  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.tokenizer import load_tokenizer
  from bagel_grain.tooling.inspect_row import stream_ended

  cfg = _config(args)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  ds = build_pipeline(cfg, tokenizer, batch_size=args.batch_size, workers=args.workers)
  it = iter(ds)
  fills, shares = [], collections.Counter()
  text_tokens = vit_tokens = vae_tokens = 0
  start = time.perf_counter()
  first, ended, L = None, False, 0
  try:
    for _ in tqdm(range(args.batches), desc="packing", unit="batch", file=sys.stderr):
      try:
        batch = next(it)
      except StopIteration:
        ended = True
        break
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
  if ended:
    print(f"{stream_ended(rows, cfg.num_epochs)}, before the {args.batches} batches asked "
          "for; what it packed:")
  if rows:
    print(f"{rows} rows of L={L} in {elapsed:.1f} s ({rows / elapsed:.2f} rows/s); "
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
    print(f"{name:16s} {w / total_w:12.3f}  {n / max(total_s, 1):12.3f}  {n / elapsed:9.1f}  "
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
  from bagel_grain.tooling.bench_data import make_bench_data  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  out = make_bench_data(args.dir, t2i_rows=args.t2i_rows, edit_rows=args.edit_rows,
                        vlm_rows=args.vlm_rows, megapixels=args.megapixels, log=_progress)
  print(f"wrote benchmark data to {out} in {time.perf_counter() - start:.1f} s")
  return 0


def _progress(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _bench(args) -> int:
  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling import bench
  from bagel_grain.tokenizer import load_tokenizer

  cfg = _config(args)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  report = bench.run_bench(cfg, tokenizer, workers=args.workers, seconds=args.seconds,
                           windows=args.windows, batch_size=args.batch_size, log=_progress)
  print(bench.format_table(report))
  for path in (args.json, args.plot):
    if path:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=float)
  if args.plot:
    bench.plot(report, args.plot)
    print(f"wrote {args.plot}")
  return 0


def _inspect(args) -> int:
  from bagel_grain.tooling.inspect_row import inspect_pipeline_row  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  print(inspect_pipeline_row(_config(args), args.out, index=args.index, seed=args.seed))
  print(f"wrote {args.out}")
  return 0


def _index(args) -> int:
  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm

  from bagel_grain.config import load_config
  from bagel_grain.sources.sidecar import index_config, verify_config

  start = time.perf_counter()
  cfg = load_config(args.config)

  def bar(total, unit, desc):
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, file=sys.stderr)

  if args.verify:
    rewritten = verify_config(cfg, bar)
    for path in rewritten:
      print(f"verified the files of {path}; it records their times now")
    print(f"verified in {time.perf_counter() - start:.1f} s"
          + ("" if rewritten else ": every file was known by its listing already"))
    return 0
  if args.runner:
    from bagel_grain.tooling import beam_runner
    beam_runner.beam()
    from bagel_grain.tooling import beam_index
    written = beam_index.run_index(cfg, args.runner, args.beam_args,
                                   split_bytes=args.split_bytes)
  else:
    written = index_config(cfg, bar)
  for path in written:
    print(f"wrote {path}")
  print(f"indexed in {time.perf_counter() - start:.1f} s")
  return 0


def _convert(args) -> int:
  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  if args.runner:
    from bagel_grain.tooling import beam_runner
    beam_runner.beam()
    from bagel_grain.tooling import beam_convert
    done = beam_convert.run_convert(args.config, args.out, args.runner, args.beam_args,
                                    records_per_shard=args.records_per_shard,
                                    overwrite=args.overwrite, num_threads=args.threads)
  else:
    from bagel_grain.tooling.convert import convert_config_file
    done = convert_config_file(args.config, args.out, records_per_shard=args.records_per_shard,
                               overwrite=args.overwrite, num_threads=args.threads)
  for d in done.datasets:
    print(f"{d.group}/{d.name}: {d.num_records} records in {len(d.files)} ArrayRecord files"
          + (f"; {d.skipped} lines longer than the text bound not converted" if d.skipped
             else ""))
  print(f"wrote {done.dataset_info}\nuse it with: --config {done.config}")
  print(f"converted in {time.perf_counter() - start:.1f} s")
  return 0


def _audit(args) -> int:
  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling import audit

  start = time.perf_counter()
  if args.runner:
    from bagel_grain.tooling import beam_runner
    beam_runner.beam()  # before anything is written: names the Beam venv when Beam is missing
  out = args.out if "://" in args.out else os.path.abspath(args.out)
  if "://" not in out:
    os.makedirs(os.path.dirname(out), exist_ok=True)
  if args.runner:
    from bagel_grain.tooling import beam_audit
    where = (os.path.abspath(args.config) if args.config and "://" not in args.config
             else args.config, args.shipped, os.path.abspath(args.data))
    report = beam_audit.run_audit(where, out, args.runner, args.beam_args, sample=args.sample,
                                  seed=args.seed, task_elements=args.task_elements)
  else:
    from bagel_grain.tokenizer import load_tokenizer
    cfg = _config(args)
    merged = audit.audit_in_process(cfg, load_tokenizer(cfg.tokenizer_path), sample=args.sample,
                                    seed=args.seed)
    report = audit.build_report(cfg, merged, sample=args.sample,
                                epoch_sizes=audit.epoch_sizes(cfg, args.seed))
  print(audit.summary(report))
  config_name = args.config or f"the shipped {args.shipped} config on {args.data}"
  json_path, png_path = audit.write_report(report, out, config_name)
  if png_path is None:
    from bagel_grain.tooling.audit_plot import HOW_TO_GET_IT
    print(HOW_TO_GET_IT)
  print(f"wrote {json_path}{' and ' + png_path if png_path else ''} in "
        f"{time.perf_counter() - start:.1f} s")
  return 0


def _replay(args) -> int:
  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm

  from bagel_grain.tokenizer import load_tokenizer
  from bagel_grain.tooling import replay

  cfg = _config(args)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  if args.png:
    os.makedirs(args.png, exist_ok=True)
  start = time.perf_counter()

  def bar(total: int):
    print(f"packing {total} batches forward from the checkpoint", file=sys.stderr)
    return tqdm(total=total, desc="replay", unit="batch", file=sys.stderr)

  batches = replay.replay(cfg, tokenizer, args.checkpoint, args.step, process=args.process,
                          processes=args.processes, batch_size=args.batch_size,
                          allow_changes=args.allow_changes, seed=args.seed,
                          workers=args.workers, progress=bar)
  for replayed in batches:
    print(replay.describe(replayed, tokenizer, cfg, width=args.width, png_dir=args.png))
  print(f"replayed in {time.perf_counter() - start:.1f} s", file=sys.stderr)
  return 0


def _ledger(args) -> int:
  from bagel_grain import ledger  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  files = ledger.open_ledger(args.dir)
  if args.step is not None:
    table = files.at_step(args.step)
    print(f"step {args.step}: {table.num_rows} samples"
          + ("" if table.num_rows else " (not in the ledger: not trained yet, or not saved)"))
    for line in table.to_pylist():
      print(f"process {line['process']} row {line['row']} shard {line['shard']} "
            f"slot {line['slot']}: {line['group']} {line['record']} epoch {line['epoch']} "
            f"index {line['index']} {line['tokens']} tokens")
  elif args.record is not None:
    table = files.of_record(args.record)
    print(f"record {args.record}: {table.num_rows} samples in {len(set(table['step'].to_pylist()))} "
          "steps")
    for line in table.to_pylist():
      print(f"step {line['step']} process {line['process']} row {line['row']} shard "
            f"{line['shard']} slot {line['slot']}: {line['group']} epoch {line['epoch']}")
  else:
    print(f"steps 0..{files.last_step()} ({len(files.segments)} segments)")
    print("group            samples          tokens  epoch")
    for group, counts in files.stats().items():
      print(f"{group:16s} {counts['samples']:8d} {counts['tokens']:15d} {counts['epoch']:6d}")
  print(f"answered in {time.perf_counter() - start:.3f} s", file=sys.stderr)
  return 0


# -- the parser ----------------------------------------------------------------


def _at_least(lowest: int):
  """An argparse type: an integer >= `lowest`."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lowest:
      raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {value}")
    return value
  parse.__name__ = f"integer >= {lowest}"
  return parse


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
  return value


class _HelpWithDefaults(argparse.HelpFormatter):
  """Appends "(default: X)" to every option that has a default worth showing."""

  def _get_help_string(self, action):
    text = action.help or ""
    default = action.default
    if default is None or default is False or default == argparse.SUPPRESS or "default:" in text:
      return text
    shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
    return f"{text} (default: {shown})"


def _version() -> str:
  # pylint: disable=import-outside-toplevel
  from importlib import metadata
  try:
    return metadata.version("bagel_grain")
  except metadata.PackageNotFoundError:
    return "unknown (not installed)"


def _add_config_options(p: argparse.ArgumentParser, shipped: str) -> None:
  from bagel_grain.configs import DATA_MAKERS  # pylint: disable=import-outside-toplevel
  maker = DATA_MAKERS[shipped]
  default_data = ".demo_data" if shipped == "demo" else ".bench_data"
  either = p.add_mutually_exclusive_group()
  either.add_argument("--config", help=f"a config YAML (default: the package's {shipped}.yaml "
                      "on the data in --data)")
  either.add_argument("--data", default=default_data,
                      help=f"the folder `bagel-grain {maker}` wrote, read by the package's "
                      f"{shipped}.yaml when --config is not given")
  p.set_defaults(shipped=shipped)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="bagel-grain", description=__doc__.split("\n")[0],
                                   formatter_class=_HelpWithDefaults)
  parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                      help="print the version and exit")
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--debug", action="store_true",
                      help="on an error, show the full traceback instead of one line")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  def command(name, run, text):
    p = sub.add_parser(name, help=text, description=text, parents=[common],
                       formatter_class=_HelpWithDefaults)
    p.set_defaults(run=run)
    return p

  p = command("make-sample-data", _make_sample_data, "write the embedded demo dataset")
  p.add_argument("dir", nargs="?", default=".demo_data", help="the folder to write")

  p = command("demo", _demo, "pack the demo data and report fill, shares and drops")
  _add_config_options(p, "demo")
  p.add_argument("--batches", type=_at_least(1), default=30, help="batches to pack")
  p.add_argument("--batch-size", type=_at_least(1), default=None,
                 help="rows per batch (default: the config's batch_size)")
  p.add_argument("--workers", type=_at_least(0), default=None,
                 help="decoding worker processes, 0 for none (default: the config's "
                 "num_workers)")

  p = command("inspect", _inspect, "draw one packed row (bands, mask, images) as a PNG")
  _add_config_options(p, "demo")
  p.add_argument("--out", default="out/row.png", help="the PNG to write")
  p.add_argument("--index", type=_at_least(0), default=0,
                 help="which packed row of the stream, from 0")
  p.add_argument("--seed", type=int, default=None,
                 help="the stream's seed (default: the config's data_seed)")

  p = command("make-bench-data", _make_bench_data,
              "write the benchmark dataset (photographs from scikit-image if installed)")
  p.add_argument("dir", nargs="?", default=".bench_data", help="the folder to write")
  p.add_argument("--t2i-rows", type=_at_least(1), default=800, help="text-to-image rows")
  p.add_argument("--edit-rows", type=_at_least(1), default=200, help="image-edit rows")
  p.add_argument("--vlm-rows", type=_at_least(1), default=400, help="VLM SFT rows")
  p.add_argument("--megapixels", type=float, nargs=2, metavar=("LO", "HI"),
                 help="photos of LO-HI megapixels (default: a long side of 256-1536 px)")

  p = command("bench", _bench, "throughput against the floor, latency, state, the main "
              "process's CPU per row and the memory split per process")
  _add_config_options(p, "bench")
  p.add_argument("--workers", type=_at_least(0), nargs="+", default=[0, 1, 2],
                 help="worker counts to measure, one run each")
  p.add_argument("--seconds", type=_positive_float, default=30.0,
                 help="timed seconds per worker count")
  p.add_argument("--windows", type=_at_least(1), default=5,
                 help="timed windows per worker count (the median is reported)")
  p.add_argument("--batch-size", type=_at_least(1), default=1, help="rows per batch")
  p.add_argument("--json", help="write the full report here (default: not written)")
  p.add_argument("--plot", help="write a PNG of throughput against worker count here "
                 "(default: not drawn)")

  p = command("index", _index, "write the sidecar index of a config's data, once per corpus: "
              "builds then read no footer and scan no JSONL file")
  p.add_argument("config", help="the config whose parquet folders and JSONL files to index")
  p.add_argument("--verify", action="store_true",
                 help="do not index: read the indexed files a listing cannot vouch for (a "
                 "local copy's new times) and check their content against the index; the "
                 "index then records their times")
  _add_runner_options(p)
  p.add_argument("--split-bytes", type=_at_least(1), default=64 << 20,
                 help="with --runner: bytes of a JSONL file per work item (a huge file is "
                 "scanned by many workers, split at line boundaries)")

  p = command("convert", _convert, "convert a config's parquet/JSONL data to ArrayRecord")
  p.add_argument("--config", required=True, help="the config whose data to convert")
  p.add_argument("--out", required=True,
                 help="the output folder; gets dataset_info.yaml and config.yaml")
  p.add_argument("--records-per-shard", type=_at_least(1), default=4096,
                 help="records per ArrayRecord file")
  p.add_argument("--overwrite", action="store_true",
                 help="delete every shard in the output and write all again (without it, the "
                 "same command after a kill resumes: complete shards are verified and kept)")
  p.add_argument("--threads", type=_at_least(1), default=16,
                 help="reader threads (per worker with --runner)")
  _add_runner_options(p)

  p = command("audit", _audit, "run every record of a config through the family transforms "
              "and the layout (no packing): drops by reason, tokens per sample, image sizes, "
              "and what a run at the configured weights will look like")
  _add_config_options(p, "demo")
  p.add_argument("--out", default="out/audit",
                 help="writes OUT.json (the report) and OUT.png (its histograms); may be a "
                 "gs:// or s3:// URI")
  p.add_argument("--sample", type=_at_least(1), default=None,
                 help="audit only the first N records of each group's shuffled epoch: a quick "
                 "estimate on one machine (default: every record)")
  p.add_argument("--seed", type=int, default=None,
                 help="the stream's seed (default: the config's data_seed and seed)")
  p.add_argument("--task-elements", type=_at_least(1), default=256,
                 help="with --runner: records of one group per work item")
  _add_runner_options(p)

  p = command("replay", _replay, "the batch the trainer took at a data step, packed forward "
              "from the nearest checkpoint: per process and row, each sample's group, record, "
              "epoch, tokens, images and text")
  _add_config_options(p, "demo")
  p.add_argument("--checkpoint", required=True,
                 help="the folder of checkpoints bagel_grain.jax.save wrote")
  p.add_argument("--step", type=_at_least(0), required=True,
                 help="the data step (batches taken before it, from 0)")
  p.add_argument("--process", type=_at_least(0), default=None,
                 help="only this process (default: every process of the run)")
  p.add_argument("--processes", type=_at_least(1), default=None,
                 help="the run's process count from that checkpoint on (default: what the "
                 "checkpoints recorded)")
  p.add_argument("--batch-size", type=_at_least(1), default=None,
                 help="rows per batch per process (default: what the checkpoints recorded)")
  p.add_argument("--allow-changes", action="store_true",
                 help="the run continued from the checkpoint under this changed config (a new "
                 "stage of training)")
  p.add_argument("--seed", type=int, default=None,
                 help="the stream's seed, if the run overrode the config's")
  p.add_argument("--workers", type=_at_least(0), default=None,
                 help="decoding worker processes (default: the config's num_workers)")
  p.add_argument("--width", type=_at_least(0), default=60, help="characters of text per sample")
  p.add_argument("--png", default=None, help="also draw each row, as inspect does, into this "
                 "folder")

  p = command("ledger", _ledger, "query a run's data ledger (device_iterator(..., ledger=)): "
              "the samples of a step, the steps of a record, or what each group gave")
  p.add_argument("dir", help="the ledger folder, or the checkpoint folder holding data_ledger/")
  what = p.add_mutually_exclusive_group(required=True)
  what.add_argument("--step", type=_at_least(0), help="the samples of this data step")
  what.add_argument("--record", help="every step that trained this record id")
  what.add_argument("--stats", action="store_true",
                    help="per group: samples, distinct records and tokens trained")
  return parser


def _add_runner_options(p: argparse.ArgumentParser) -> None:
  from bagel_grain.tooling.beam_runner import RUNNER_HELP  # pylint: disable=import-outside-toplevel
  p.add_argument("--runner", default=None, help=RUNNER_HELP)
  p.set_defaults(beam_args=[])


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split()) or "(no message)"
  # pylint: disable=import-outside-toplevel
  from bagel_grain.errors import BagelGrainError
  return text if isinstance(error, BagelGrainError) else f"{type(error).__name__}: {text}"


def main(argv=None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  if extra and not getattr(args, "runner", None):
    parser.error(f"unrecognized arguments: {' '.join(extra)}"
                 + (" (Beam's options need --runner)" if hasattr(args, "runner") else ""))
  args.beam_args = extra
  try:
    return args.run(args)
  except KeyboardInterrupt:
    if args.debug:
      raise
    print(f"bagel-grain {args.command}: interrupted", file=sys.stderr)
    return 130
  except Exception as e:  # pylint: disable=broad-except
    if args.debug:
      raise
    print(f"bagel-grain {args.command}: error: {_one_line(e)} (--debug shows the traceback)",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
