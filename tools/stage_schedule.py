"""A two-stage training schedule on the demo data, carried across by the checkpoint.

Stage 1 reads the demo config's T2I and edit groups; after `--steps` steps it saves
a checkpoint (Orbax, as a trainer does). Stage 2 is the next stage of training:
the edit group's weight changes and the VLM group joins. It restores the stage-1
checkpoint with `allow_changes=True` and runs to the end of the epoch
(`num_epochs: 1`). The script then checks that every record of the epoch was packed
exactly once, and prints what each stage packed.

    python tools/stage_schedule.py --data .demo_data --steps 3
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp

from bagel_grain import build_pipeline
from bagel_grain import jax as bgj
from bagel_grain.configs import load_shipped
from bagel_grain.pipeline import group_records
from bagel_grain.tokenizer import load_tokenizer


def stage_config(data: Path, groups: list[str], weights: dict[str, float]):
  """The demo config with these groups (in this order) and weights, one epoch."""
  cfg = load_shipped("demo", data)
  named = {g.name: g for g in cfg.groups}
  chosen = tuple(dataclasses.replace(named[n], weight=weights.get(n, named[n].weight))
                 for n in groups)
  return dataclasses.replace(cfg, groups=chosen, num_epochs=1)


def packed(batch) -> collections.Counter:
  return collections.Counter((k[0], k[3]) for row in batch["sample_keys"] for k in row)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", type=Path, required=True, help="bagel-grain make-sample-data's folder")
  parser.add_argument("--steps", type=int, default=3, help="stage 1's steps (default: 3)")
  args = parser.parse_args(argv)
  stage_1 = stage_config(args.data, ["t2i_pretrain", "unified_edit"], {})
  stage_2 = stage_config(args.data, ["t2i_pretrain", "unified_edit", "vlm_sft"],
                         {"unified_edit": 4.0})
  tokenizer = load_tokenizer(stage_1.tokenizer_path)
  model = {"w": jnp.zeros(4)}
  counts = collections.Counter()
  with tempfile.TemporaryDirectory() as folder:
    manager = bgj.checkpoint_manager(folder)
    with iter(build_pipeline(stage_1, tokenizer, batch_size=2, workers=0)) as it:
      for step in range(1, args.steps + 1):
        counts += packed(next(it))
      bgj.save(manager, step, model, it)
    first = sum(counts.values())
    with iter(build_pipeline(stage_2, tokenizer, batch_size=2, workers=0)) as it:
      bgj.restore(manager, None, model, it, allow_changes=True)
      for batch in it:
        counts += packed(batch)
    manager.close()
  twice = [key for key, n in counts.items() if n > 1]
  by_group = collections.Counter(group for group, _ in counts)
  expected = {g.name: group_records(stage_2, i, seed=stage_2.data_seed).records_per_epoch
              for i, g in enumerate(stage_2.groups)}
  print(f"stage 1: {first} samples in {args.steps} steps; stage 2 (weights "
        f"{ {g.name: g.weight for g in stage_2.groups} }): {sum(counts.values()) - first}")
  print(f"packed per group: {dict(by_group)}; the epoch holds {expected}")
  ok = not twice and dict(by_group) == expected
  print(f"every record of the epoch packed once: {'yes' if ok else 'NO'}"
        f"{'' if not twice else f' ({len(twice)} twice)'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
