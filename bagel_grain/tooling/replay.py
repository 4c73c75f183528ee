"""`bagel-grain replay`: the batch of data step N, rebuilt from the nearest checkpoint.

The stream is a pure function of (config, tokenizer, seed, process index, process
count), and a checkpoint written by `bagel_grain.jax.save` holds its position at a
step: restore the nearest saved step at or before N for each process (before the
first, the stream's start), pack forward (N - saved) batches, and the next batch is
the one the trainer took at step N. The
process count and rows per batch are those of the run that trained from that
checkpoint on (the next checkpoint's, else its own); a config that is not the
checkpoint's stream is refused by `set_state`, naming the fields that differ.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Callable, Sequence

import numpy as np
from etils import epath

from bagel_grain.config import PipelineConfig
from bagel_grain.errors import BagelGrainError, StateMismatchError
from bagel_grain.jax.checkpoint import DATA, batches_taken, restore_shard_states, shard_files
from bagel_grain.ledger import row_shards
from bagel_grain.pipeline import build_pipeline


class ReplayError(BagelGrainError):
  """No checkpoint to replay a step from, or a step the checkpoints cannot reach."""


@dataclasses.dataclass(frozen=True)
class SavedStep:
  """One checkpoint step's data: where, and the facts its save recorded."""

  step: int
  data: epath.Path
  save: dict[str, Any]

  @property
  def batches(self) -> int:
    return batches_taken(self.save, self.step)


@dataclasses.dataclass(frozen=True)
class ReplayedBatch:
  """Process `process`'s batch at data step `step`, packed from checkpoint `saved`."""

  step: int
  process: int
  processes: int
  saved: SavedStep | None  # None: packed from the stream's start
  batch: dict[str, Any]
  shards: list[int]  # the logical shard of each row (-1: a padding row)


def saved_steps(checkpoint_dir: str | os.PathLike) -> list[SavedStep]:
  """The checkpoint's complete steps that hold the pipeline's shard files, by data step."""
  root = epath.Path(checkpoint_dir)
  out = []
  for path in root.iterdir() if root.is_dir() else ():
    data = path / DATA
    if not (path.name.isdigit() and data.is_dir()):
      continue  # Orbax's temporary folders of a save in progress, the ledger
    names = sorted(shard_files(data))
    if not names:
      continue
    save = json.loads((data / names[0]).read_text()).get("save") or {}
    out.append(SavedStep(int(path.name), data, save if isinstance(save, dict) else {}))
  return sorted(out, key=lambda s: s.batches)


def choose(steps: Sequence[SavedStep],
           step: int) -> tuple[SavedStep | None, SavedStep | None]:
  """The nearest saved step at or before `step` (None: the stream's start), and the next
  one (which the run that trained from it wrote: its process count and batch are the
  ones to replay with)."""
  if not steps:
    raise ReplayError("no checkpoint holding the pipeline's shard files there: was it "
                      "written by bagel_grain.jax.save?")
  before = [s for s in steps if s.batches <= step]
  after = [s for s in steps if s.batches > step]
  return (before[-1] if before else None), (after[0] if after else None)


def replay(cfg: PipelineConfig, tokenizer, checkpoint_dir: str | os.PathLike, step: int, *,
           process: int | None = None, processes: int | None = None,
           batch_size: int | None = None, allow_changes: bool = False,
           seed: int | None = None, workers: int | None = None,
           progress: Callable[[int], Any] | None = None) -> list[ReplayedBatch]:
  """The batch of data `step` of every process (or `process` only).

  `processes`, `batch_size`: what the run had from that checkpoint on (default: what
  the checkpoints recorded). `allow_changes`: the run continued from the checkpoint
  under this changed config (a new stage, `bagel_grain.jax.restore(allow_changes=True)`).
  `progress(total)` returns a tqdm-like bar updated once per batch packed forward.
  """
  saved, later = choose(saved_steps(checkpoint_dir), step)
  facts = (later or saved).save
  processes = processes or facts.get("processes") or _shard_count(later or saved)
  batch_size = batch_size or facts.get("batch_size") or cfg.batch_size
  chosen = range(processes) if process is None else [process]
  if process is not None and not 0 <= process < processes:
    raise ReplayError(f"process {process} is not one of the run's {processes} processes")
  start = saved.batches if saved else 0
  bar = progress(len(chosen) * (step - start)) if progress else None
  out = []
  try:
    for p in chosen:
      out.append(_replay_one(cfg, tokenizer, saved or later, step, p, processes, batch_size,
                             allow_changes=allow_changes, seed=seed, workers=workers, bar=bar,
                             from_start=saved is None))
  finally:
    if bar is not None:
      bar.close()
  return out


def _shard_count(saved: SavedStep) -> int:
  return int(next(iter(shard_files(saved.data).values())).group(2))


def _replay_one(cfg, tokenizer, saved: SavedStep, step: int, process: int, processes: int,
                batch_size: int, *, allow_changes: bool, seed: int | None,
                workers: int | None, bar, from_start: bool) -> ReplayedBatch:
  """From `saved`, or from the stream's start when `from_start` (`saved`, the first
  checkpoint, then only checks that the config makes its stream)."""
  it = iter(build_pipeline(cfg, tokenizer, seed=seed, process_index=process,
                           process_count=processes, batch_size=batch_size, workers=workers))
  try:
    start = it.get_state()
    try:
      restore_shard_states(saved.data, it, step=saved.step, allow_changes=allow_changes)
    except StateMismatchError as e:
      raise StateMismatchError(
          f"the config does not make the stream checkpoint step {saved.step} saved (process "
          f"{process} of {processes}): {e}. Replay with the config of the run; pass "
          "--allow-changes if the run continued from this checkpoint on a new stage") from e
    if from_start:
      it.set_state(start)
    for _ in range(step - (0 if from_start else saved.batches)):
      next(it)
      if bar is not None:
        bar.update(1)
    before = it.get_state()
    batch = next(it)
    shards = row_shards(before, it.get_state(), sum(1 for k in batch["sample_keys"] if k))
  finally:
    it.close()
  return ReplayedBatch(step, process, processes, None if from_start else saved, batch, shards)


# -- what is printed --------------------------------------------------------------------


def sample_lines(row: dict[str, Any], tokenizer, *, width: int, vit_patch_size: int,
                 max_num_patch_per_side: int) -> list[str]:
  """Per sample of a packed row (arrays without the batch dimension): group, record id,
  epoch, tokens, its images' sizes and the start of its text."""
  seg = np.asarray(row["segment_ids"])
  token_type = np.asarray(row["token_type"])
  latent = token_type == 3
  vae_hw = np.asarray(row["vae_image_hw"])
  vit_at = np.asarray(row["vit_token_index"])
  vit_ids = np.asarray(row["vit_image_ids"])
  vit_pos = np.asarray(row["vit_position_ids"])
  lines, vae_slot = [], 0
  for s, key in enumerate(row["sample_keys"], start=1):
    mine = seg == s
    positions = np.flatnonzero(mine)
    runs = int(np.sum(latent[mine][1:] & ~latent[mine][:-1]) + latent[mine][0])
    vae = [f"{h}x{w}" for h, w in vae_hw[vae_slot:vae_slot + runs]]
    vae_slot += runs
    vit = []
    for image in np.unique(vit_ids[np.isin(vit_at, positions)]):
      r, c = np.divmod(vit_pos[vit_ids == image], max_num_patch_per_side)
      vit.append(f"{(r.max() + 1) * vit_patch_size}x{(c.max() + 1) * vit_patch_size}")
    text = tokenizer.decode(np.asarray(row["text_ids"])[mine & (token_type == 1)])
    text = " ".join(text.split())
    text = text if len(text) <= width else text[:max(width - 3, 0)] + "..."
    group, _, epoch, record = key
    lines.append(f"  {s - 1:3d} {group:14s} {record}  epoch {epoch}  {len(positions)} tokens"
                 f"{_sizes('VAE', vae)}{_sizes('ViT', vit)}  {json.dumps(text)}")
  return lines


def _sizes(kind: str, sizes: list[str]) -> str:
  if not sizes:
    return ""
  counted = collections.Counter(sizes)
  return f"  {kind} " + ", ".join(f"{n}x {size}" if n > 1 else size
                                  for size, n in counted.items())


def describe(replayed: ReplayedBatch, tokenizer, cfg: PipelineConfig, *, width: int = 60,
             png_dir: str | None = None) -> str:
  """What `bagel-grain replay` prints for one process (and the PNGs it draws)."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling.inspect_row import inspect_row
  r = replayed
  origin = f"checkpoint step {r.saved.step}" if r.saved else "the stream's start"
  lines = [f"step {r.step}, process {r.process} of {r.processes} (from {origin}, "
           f"{r.step - (r.saved.batches if r.saved else 0)} batches packed forward)"]
  for b, keys in enumerate(r.batch["sample_keys"]):
    if not keys:
      lines.append(f" row {b}: empty (the end of a finite stream)")
      continue
    row = {name: value[b] for name, value in r.batch.items()}
    lines.append(f" row {b} (logical shard {r.shards[b]}): {len(keys)} samples, "
                 f"{int(row['num_tokens'])} tokens")
    lines.extend(sample_lines(row, tokenizer, width=width, vit_patch_size=cfg.vit_patch_size,
                              max_num_patch_per_side=cfg.max_num_patch_per_side))
    if png_dir:
      path = os.path.join(png_dir, f"step{r.step}_process{r.process}_row{b}.png")
      inspect_row(row, path, vit_patch_size=cfg.vit_patch_size,
                  max_num_patch_per_side=cfg.max_num_patch_per_side)
      lines.append(f"  drawn to {path}")
  return "\n".join(lines)
