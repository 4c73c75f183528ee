"""Where a sample's CPU time goes, per family: record read, decode+resize, tokenizing, the
rest of the family's parse, and the layout, against the decode+resize floor.

Each group's first `--samples` elements (this process's order, as the pipeline draws
them) are made one stage at a time in this thread, each stage timed in CPU seconds of
this thread (`time.thread_time`: steady on a shared machine, where wall-clock is not):

- read: the record from its source (parquet row group decode and row to Python values,
  or the JSONL line), as `ShuffledRecords` serves it, without read-ahead;
- files: image files beside a JSONL line (`DiskFiles.read`);
- decode+resize: `images.decode_resized` (what the bench's floor measures) and image
  headers read for sizes (`images.image_size`);
- tokenize: the tokenizer's `encode_batch`;
- parse (rest): the family's own work around those (captions, JSON, plans);
- layout: `PrepareSample` (dropout draws, token layout, ViT patchify).

The share of each stage, per family and over all of them weighted by how often the
mixture draws each group (its weight), says what keeps the pipeline above the floor.
`--cprofile N` also prints the N costliest functions of each family.

    python tools/family_profile.py --data .bench_data --samples 60
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from typing import Any, Callable

import numpy as np

STAGES = ("read", "files", "decode+resize", "tokenize", "parse (rest)", "layout")


class _Clock:
  """CPU seconds of this thread spent inside wrapped calls, by stage (outermost wins)."""

  def __init__(self):
    self.seconds = dict.fromkeys(STAGES, 0.0)
    self._inside = False

  def wrap(self, stage: str, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
      if self._inside:
        return fn(*args, **kwargs)
      self._inside, start = True, time.thread_time()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[stage] += time.thread_time() - start
        self._inside = False
    return timed

  @contextlib.contextmanager
  def stage(self, stage: str):
    start = time.thread_time()
    try:
      yield
    finally:
      self.seconds[stage] += time.thread_time() - start


def profile_group(cfg, group: int, tokenizer, samples: int, *, cprofile: int = 0
                  ) -> dict[str, Any]:
  """One group's first `samples` elements, stage by stage (see the module's docstring)."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain import pipeline
  from bagel_grain.families import base, files, vlm
  from bagel_grain.packing.layout import Geometry
  from bagel_grain.packing.prepare import PrepareSample, resized_image_tokens
  from bagel_grain.sample import Sample
  clock = _Clock()
  order_seed, seed = pipeline.stream_seeds(cfg)
  records = pipeline.group_records(cfg, group, seed=order_seed)
  family = pipeline.family_transform(cfg, group, tokenizer)
  prepare = PrepareSample(seed, Geometry(cfg.vit_patch_size, cfg.vae_image_downsample,
                                         cfg.max_num_patch_per_side, cfg.max_latent_size,
                                         cfg.interpolate_pos),
                          tokenizer.special, cfg.text_cond_dropout_prob,
                          cfg.vit_cond_dropout_prob, cfg.vae_cond_dropout_prob)
  patched = [(base, "decode_resized", "decode+resize"), (vlm, "image_size", "decode+resize"),
             (files.DiskFiles, "read", "files")]
  saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
  encode_batch = tokenizer.encode_batch
  profiler = cProfile.Profile() if cprofile else None
  for owner, name, stage in patched:
    setattr(owner, name, clock.wrap(stage, getattr(owner, name)))
  tokenizer.encode_batch = clock.wrap("tokenize", encode_batch)
  made = image_tokens = 0
  total = 0.0
  try:
    for index in range(min(samples, len(records))):
      rng = np.random.default_rng(index)  # choices need not match the stream's here
      start = time.thread_time()
      if profiler:
        profiler.enable()
      with clock.stage("read"):
        record = records[index]
      sample = family.random_map(record, rng)
      if isinstance(sample, Sample):
        with clock.stage("layout"):
          prepare.map(sample)
        made += 1
        image_tokens += resized_image_tokens(sample, vit_patch_size=cfg.vit_patch_size,
                                             vae_downsample=cfg.vae_image_downsample)
      if profiler:
        profiler.disable()
      total += time.thread_time() - start
  finally:
    for owner, name, fn in saved:
      setattr(owner, name, fn)
    tokenizer.encode_batch = encode_batch
  accounted = sum(v for k, v in clock.seconds.items() if k != "parse (rest)")
  clock.seconds["parse (rest)"] = total - accounted
  out = {"group": cfg.groups[group].name, "samples": made, "cpu_s": total,
         "ms_per_sample": {k: v / max(made, 1) * 1e3 for k, v in clock.seconds.items()},
         "share": {k: v / total for k, v in clock.seconds.items()} if total else {},
         "image_tokens_per_cpu_s": image_tokens / total if total else 0.0,
         "floor_image_tokens_per_cpu_s": (image_tokens / clock.seconds["decode+resize"]
                                          if clock.seconds["decode+resize"] else None)}
  if profiler:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(cprofile)
    out["cprofile"] = text.getvalue()
  return out


def mixed_shares(results: list[dict[str, Any]], weights: list[float]) -> dict[str, float]:
  """Each stage's share of the CPU time of a mixture that draws group g with weight w_g:
  per-sample times weighted by the draws, summed, over the total."""
  per_stage = {stage: sum(w * r["ms_per_sample"][stage] for r, w in zip(results, weights))
               for stage in STAGES}
  total = sum(per_stage.values())
  return {stage: t / total for stage, t in per_stage.items()} if total else {}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", help="a config of yours (default: the shipped bench config)")
  parser.add_argument("--data", default=".bench_data", help="data of the shipped bench config")
  parser.add_argument("--samples", type=int, default=60, help="elements per group")
  parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                      help="also print each family's N costliest functions")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args()
  import bagel_grain  # pylint: disable=import-outside-toplevel
  from bagel_grain.configs import load_shipped  # pylint: disable=import-outside-toplevel
  cfg = bagel_grain.load_config(args.config) if args.config else load_shipped("bench", args.data)
  tokenizer = bagel_grain.load_tokenizer(cfg.tokenizer_path)
  results = [profile_group(cfg, g, tokenizer, args.samples, cprofile=args.cprofile)
             for g in range(len(cfg.groups))]
  print(f"{'family':14s} samples  ms/sample  " + "  ".join(f"{s:>13s}" for s in STAGES)
        + "  img tok/CPU s  x decode alone")
  for r in results:
    total = sum(r["ms_per_sample"].values())
    floor = r["floor_image_tokens_per_cpu_s"]
    print(f"{r['group']:14s} {r['samples']:7d}  {total:9.1f}  " + "  ".join(
        f"{r['ms_per_sample'][s]:6.1f} ({r['share'][s]:3.0%})" for s in STAGES)
          + f"  {r['image_tokens_per_cpu_s']:13,.0f}  "
          + (f"{r['image_tokens_per_cpu_s'] / floor:14.2f}" if floor else "-"))
  shares = mixed_shares(results, [g.weight for g in cfg.groups])
  print("mixture (weights " + ", ".join(f"{g.name} {g.weight:g}" for g in cfg.groups) + "): "
        + ", ".join(f"{s} {v:.0%}" for s, v in shares.items()))
  for r in results:
    if "cprofile" in r:
      print(f"--- {r['group']}\n{r['cprofile']}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"groups": results, "mixture": shares}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
