"""A tiny JAX model trained on the packed pipeline: every row field used, checkpoint, resume.

Runs the demo data through the whole path (Grain pipeline -> global sharded
batches -> jitted train step on a data-parallel mesh over all devices), twice:
once for `--steps` steps without a break, once saving model and iterator state
with Orbax at `--ckpt-step`, then starting over from a fresh pipeline restored
from that checkpoint. Both runs must reach the same loss at the last step, and
the train step must compile once (static row shapes).

The model is a stand-in for BAGEL's, small enough for a CPU:
- text: a token embedding (tied to the output head) at text/marker positions;
- ViT: normalised patches projected to D, plus a 2-D position embedding;
- VAE: each image average-pooled to its latent grid (stride d) stands in for
  the VAE latent; latent tokens of loss images are noised by flow matching
  (`x_t = (1 - s) x0 + s eps`, s = sigmoid(timestep); clean conditions have
  timestep -inf, so s = 0), plus a latent position and a timestep embedding;
- attention: a few pre-norm transformer layers under the packed mask, computed
  tile by tile with an online softmax and never as L x L: `block_summary` tells
  which tiles the mask rules out (skipped), which it leaves whole (no mask), and
  `mask_block` masks the rest; each step prints the share of tiles skipped;
- loss: CE on `label_ids` weighted by `ce_weights`, plus MSE of the predicted
  velocity `eps - x0` on `mse_mask` tokens.

    bagel-grain make-sample-data .demo_data
    python tools/train_example.py --data .demo_data --steps 8 --ckpt-step 4

The checkpoints go to a temporary folder, removed at the end (`--workdir` keeps them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import bagel_grain
from bagel_grain import jax as bgj
from bagel_grain.config import PipelineConfig
from bagel_grain.configs import load_shipped
from bagel_grain.jax.attention import EMPTY_BLOCK, FULL_BLOCK, PARTIAL_BLOCK
from bagel_grain.pipeline import build_pipeline

_BACKEND_COMPILES = collections.Counter()


def _count_compiles(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    _BACKEND_COMPILES["total"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


# -- configuration -------------------------------------------------------------


def shrink_config(cfg: PipelineConfig, *, max_num_tokens: int | None = None,
                  max_image_size: int | None = None) -> PipelineConfig:
  """A smaller copy of `cfg` for quick runs: a token budget and an image-size cap."""
  if max_num_tokens is not None:
    expected = max_num_tokens * 3 // 4
    cfg = dataclasses.replace(cfg, max_num_tokens=max_num_tokens, expected_num_tokens=expected,
                              max_num_tokens_per_sample=expected,
                              prefer_buffer_before=expected // 2)
  if max_image_size is not None:
    def cap(t):
      if t is None:
        return None
      return dataclasses.replace(t, max_image_size=min(t.max_image_size, max_image_size),
                                 min_image_size=min(t.min_image_size, max_image_size // 2))
    cfg = dataclasses.replace(cfg, groups=tuple(
        dataclasses.replace(g, image_transform=cap(g.image_transform),
                            vit_image_transform=cap(g.vit_image_transform))
        for g in cfg.groups))
  return cfg


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  patch_features: int  # p * p * 3
  vae_downsample: int
  max_num_patch_per_side: int
  max_latent_size: int
  dim: int = 64
  layers: int = 2
  heads: int = 4
  latent_channels: int = 3


# -- model ---------------------------------------------------------------------


def init_params(key: jax.Array, mc: ModelConfig) -> dict[str, Any]:
  d = mc.dim
  keys = iter(jax.random.split(key, 8 + 4 * mc.layers))

  def dense(shape, scale=None):
    scale = 1.0 / math.sqrt(shape[0]) if scale is None else scale
    return jax.random.normal(next(keys), shape, jnp.float32) * scale

  return {
      "embed": dense((mc.vocab_size, d), 0.02),
      "vit_in": dense((mc.patch_features, d)),
      "vit_pos": dense((mc.max_num_patch_per_side ** 2, d), 0.02),
      "vae_in": dense((mc.latent_channels, d)),
      "vae_pos": dense((mc.max_latent_size ** 2, d), 0.02),
      "time": dense((1, d), 0.02)[0],
      "vae_out": dense((d, mc.latent_channels)),
      "norm": jnp.ones(d),
      "layers": [{
          "norm1": jnp.ones(d), "qkv": dense((d, 3 * d)), "out": dense((d, d)),
          "norm2": jnp.ones(d), "up": dense((d, 4 * d)), "down": dense((4 * d, d)),
      } for _ in range(mc.layers)],
  }


def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def sinusoid(positions, dim):
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(dim // 2) / (dim // 2))
  angles = positions[..., None].astype(jnp.float32) * freqs
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1)


# -- attention, tile by tile over the packed mask --------------------------------
#
# A flash-attention-style kernel in plain JAX: the mask is never materialised. Each
# row's mask is its per-key query intervals; `block_summary` classifies every
# tile x tile block as empty (skipped: never visited), full (no mask needed) or
# partial (masked from `mask_block`). Only the non-empty tiles are listed and
# visited, in one loop, with an online softmax; the backward pass recomputes
# each tile's probabilities from the saved log-sum-exp and visits the same tiles.


def tile_size(length: int) -> int:
  """256-position tiles where they divide the row, else 128 (L is a multiple of 128)."""
  return math.gcd(length, 256)


class _Tiles(NamedTuple):
  """The non-empty tiles of a batch, flattened over (row, query tile, key tile)."""

  index: jax.Array  # int32 [b * nq * nk]: flat tile numbers, the non-empty ones first
  count: jax.Array  # int32 []: how many are non-empty
  kind: jax.Array  # int8 [b * nq * nk]: block_summary's code of each flat tile number


def _tiles(summary: jax.Array) -> _Tiles:
  kind = summary.reshape(-1)
  seen = kind != EMPTY_BLOCK
  index = jnp.nonzero(seen, size=kind.size, fill_value=0)[0].astype(jnp.int32)
  return _Tiles(index, jnp.sum(seen, dtype=jnp.int32), kind)


def _tile_scores(q, k, intervals, tiles, i, block):
  """Scaled scores [h, block, block] of the i-th non-empty tile, -inf where masked;
  and where the tile is: (row, first query, first key)."""
  n = q.shape[2] // block
  flat = tiles.index[i]
  row, q0, k0 = flat // (n * n), flat // n % n * block, flat % n * block
  scores = jnp.einsum("hqc,hkc->hqk", _slice(q, row, q0, block),
                      _slice(k, row, k0, block)) / math.sqrt(q.shape[-1])

  def masked(scores):
    tile_intervals = bgj.KeyIntervals(
        *(lax.dynamic_slice(x, (row, k0), (1, block))[0] for x in intervals))
    visible = bgj.mask_block(tile_intervals, q0 + jnp.arange(block)[:, None],
                             jnp.arange(block)[None, :])
    return jnp.where(visible[None], scores, -jnp.inf)

  scores = lax.cond(tiles.kind[flat] == PARTIAL_BLOCK, masked, lambda s: s, scores)
  return scores, (row, q0, k0)


def _slice(x, row, start, block):
  """x[row, :, start:start + block] of a [b, h, L, ...] array."""
  starts = (row, 0, start) + (0,) * (x.ndim - 3)
  return lax.dynamic_slice(x, starts, (1, x.shape[1], block) + x.shape[3:])[0]


def _put(x, row, start, new):
  """x[row, :, start:start + block] = new."""
  return lax.dynamic_update_slice(x, new[None], (row, 0, start) + (0,) * (x.ndim - 3))


def _add(x, row, start, update):
  """x[row, :, start:start + block] += update."""
  return _put(x, row, start, _slice(x, row, start, update.shape[1]) + update)


def _attention_forward(q, k, v, intervals, summary, block):
  """Output [b, h, L, c] and log-sum-exp [b, h, L] (+inf for queries that see nothing)."""
  tiles = _tiles(summary)

  def visit(i, carry):
    m, l, acc = carry  # per query: running max, sum of exp(score - max), weighted values
    scores, (row, q0, k0) = _tile_scores(q, k, intervals, tiles, i, block)
    m_old = _slice(m, row, q0, block)
    m_new = jnp.maximum(m_old, scores.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a query that sees nothing yet
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m_old - m_safe)
    l_new = alpha * _slice(l, row, q0, block) + p.sum(-1)
    acc_new = alpha[..., None] * _slice(acc, row, q0, block) + jnp.einsum(
        "hqk,hkc->hqc", p, _slice(v, row, k0, block))
    return _put(m, row, q0, m_new), _put(l, row, q0, l_new), _put(acc, row, q0, acc_new)

  per_query = q[..., 0]  # *_like: under shard_map the carry varies over devices as q does
  init = (jnp.full_like(per_query, -jnp.inf), jnp.zeros_like(per_query), jnp.zeros_like(q))
  m, l, acc = lax.fori_loop(0, tiles.count, visit, init)
  seen = l > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
  return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def tiled_attention(q, k, v, intervals, summary, block):
  """Attention of [b, h, L, c] queries, keys, values under the packed mask, tile by tile.

  `summary` is `block_summary(intervals, block, block)`. Queries that see no key
  (padding) get zeros.
  """
  return _attention_forward(q, k, v, intervals, summary, block)[0]


def _tiled_attention_fwd(q, k, v, intervals, summary, block):
  out, lse = _attention_forward(q, k, v, intervals, summary, block)
  return out, (q, k, v, intervals, summary, out, lse)


def _tiled_attention_bwd(block, saved, d_out):
  q, k, v, intervals, summary, out, lse = saved
  tiles = _tiles(summary)
  delta = jnp.sum(d_out * out, -1)  # [b, h, L]: sum_k p * dp, per query
  c = q.shape[-1]

  def visit(i, grads):
    dq, dk, dv = grads
    scores, (row, q0, k0) = _tile_scores(q, k, intervals, tiles, i, block)
    p = jnp.exp(scores - _slice(lse, row, q0, block)[..., None])
    do = _slice(d_out, row, q0, block)
    dp = jnp.einsum("hqc,hkc->hqk", do, _slice(v, row, k0, block))
    ds = p * (dp - _slice(delta, row, q0, block)[..., None]) / math.sqrt(c)
    dq = _add(dq, row, q0, jnp.einsum("hqk,hkc->hqc", ds, _slice(k, row, k0, block)))
    dk = _add(dk, row, k0, jnp.einsum("hqk,hqc->hkc", ds, _slice(q, row, q0, block)))
    dv = _add(dv, row, k0, jnp.einsum("hqk,hqc->hkc", p, do))
    return dq, dk, dv

  zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
  dq, dk, dv = lax.fori_loop(0, tiles.count, visit, zeros)
  return dq, dk, dv, None, None


tiled_attention.defvjp(_tiled_attention_fwd, _tiled_attention_bwd)


def sharded_attention(mesh, intervals, summary, block):
  """`tiled_attention` run by each device on its own rows (the batch axis is "data")."""
  rows = PartitionSpec("data")
  per_device = jax.shard_map(
      lambda q, k, v, intervals, summary: tiled_attention(q, k, v, intervals, summary, block),
      mesh=mesh, in_specs=(rows,) * 5, out_specs=rows)
  return lambda q, k, v: per_device(q, k, v, intervals, summary)


def attention_layer(p, h, attend, heads):
  b, length, d = h.shape
  x = rms_norm(h, p["norm1"])
  q, k, v = jnp.split(x @ p["qkv"], 3, -1)
  q, k, v = (t.reshape(b, length, heads, d // heads).transpose(0, 2, 1, 3) for t in (q, k, v))
  att = attend(q, k, v).transpose(0, 2, 1, 3).reshape(b, length, d)
  h = h + att @ p["out"]
  x = rms_norm(h, p["norm2"])
  return h + jax.nn.gelu(x @ p["up"]) @ p["down"]


def loss_fn(params, batch, noise_key, mc: ModelConfig, mesh):
  """CE + flow-matching MSE of one global batch; uses every row field."""
  tokens = batch["text_ids"]
  b, length = tokens.shape
  px = bgj.prepare_pixels(batch)

  text = params["embed"][tokens]
  vit = px["vit_patches"] @ params["vit_in"] + params["vit_pos"][batch["vit_position_ids"]]

  # VAE stand-in: each image pooled to its d x d latent grid, tokens read image by image.
  images = px["vae_images"]
  n_img, size, dd = images.shape[1], images.shape[2], mc.vae_downsample
  grid = images.reshape(b, n_img, size // dd, dd, size // dd, dd, 3).mean((3, 5))
  vae_index = batch["vae_token_index"]
  num_slots = vae_index.shape[1]
  x0 = bgj.gather_vae_latents(grid, batch["vae_image_hw"], num_slots, dd)
  at_latent = jnp.clip(vae_index, 0, length - 1)
  t = jnp.take_along_axis(batch["timesteps"], at_latent, 1)
  s = jnp.where(jnp.isfinite(t), jax.nn.sigmoid(t), 0.0)[..., None]
  noise = jax.random.normal(noise_key, x0.shape)
  x_t = (1 - s) * x0 + s * noise
  vae = (x_t @ params["vae_in"] + params["vae_pos"][batch["vae_latent_position_ids"]]
         + s * params["time"])

  h = bgj.assemble_sequence(batch["token_type"], text, vit, batch["vit_token_index"], vae,
                            vae_index)
  h = h + sinusoid(batch["position_ids"], mc.dim)
  intervals = bgj.key_intervals(batch["segment_ids"], batch["split_ids"], batch["split_modes"])
  block = tile_size(length)
  summary = bgj.block_summary(intervals, block, block)
  attend = sharded_attention(mesh, intervals, summary, block)
  for layer in params["layers"]:
    h = attention_layer(layer, h, attend, mc.heads)
  h = rms_norm(h, params["norm"])

  logits = h @ params["embed"].T
  nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
      logits, batch["label_ids"][..., None], -1)[..., 0]
  w = batch["ce_weights"]
  ce = jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1e-6)

  velocity = bgj.gather_tokens(h, vae_index) @ params["vae_out"]
  noised = jnp.take_along_axis(batch["mse_mask"], at_latent, 1) & (vae_index < length)
  err = jnp.mean((velocity - (noise - x0)) ** 2, -1)
  mse = jnp.sum(jnp.where(noised, err, 0.0)) / jnp.maximum(jnp.sum(noised), 1)
  tiles = {"tiles_skipped": jnp.mean(summary == EMPTY_BLOCK),
           "tiles_unmasked": jnp.mean(summary == FULL_BLOCK)}
  return ce + mse, {"ce": ce, "mse": mse, **tiles}


def adam(state, grads, lr=3e-3, b1=0.9, b2=0.99, eps=1e-8):
  step = state["step"] + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
  c1, c2 = 1 - b1 ** step.astype(jnp.float32), 1 - b2 ** step.astype(jnp.float32)
  params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps),
                        state["params"], m, v)
  return {"params": params, "m": m, "v": v, "step": step}


def make_train_step(mc: ModelConfig, mesh, seed: int, traces: collections.Counter):
  replicated = NamedSharding(mesh, PartitionSpec())

  def train_step(state, batch):
    traces["train_step"] += 1  # runs at trace time only
    noise_key = jax.random.fold_in(jax.random.key(seed), state["step"])
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], batch, noise_key, mc, mesh)
    return adam(state, grads), {"loss": loss, **metrics}

  return jax.jit(train_step, out_shardings=replicated)


def init_state(mc: ModelConfig, mesh, seed: int):
  params = init_params(jax.random.key(seed), mc)
  zeros = jax.tree.map(jnp.zeros_like, params)
  state = {"params": params, "m": zeros, "v": jax.tree.map(jnp.zeros_like, params),
           "step": jnp.zeros((), jnp.int32)}
  return jax.device_put(state, NamedSharding(mesh, PartitionSpec()))


# -- the two runs --------------------------------------------------------------


def _data(cfg, tokenizer, batch_size, mesh, workers):
  ds = build_pipeline(cfg, tokenizer, batch_size=batch_size, process_index=jax.process_index(),
                      process_count=jax.process_count(), workers=workers)
  return bgj.device_iterator(ds, mesh, data_axes="data", buffer_size=2)


def _train(train_step, state, data, steps, log):
  losses, skipped = [], []
  for _ in range(steps):
    batch = next(data)
    before = _BACKEND_COMPILES["total"]
    state, metrics = train_step(state, batch.arrays)
    losses.append(float(metrics["loss"]))
    skipped.append(float(metrics["tiles_skipped"]))
    _BACKEND_COMPILES["steps"] += 1
    if _BACKEND_COMPILES["steps"] > 1:  # any compile after the very first step is a recompile
      _BACKEND_COMPILES["in_later_steps"] += _BACKEND_COMPILES["total"] - before
    log(f"step {int(state['step']):3d}  loss {losses[-1]:.6f}  ce {float(metrics['ce']):.4f}  "
        f"mse {float(metrics['mse']):.4f}  rows {len(batch.sample_keys)}  tiles skipped "
        f"{skipped[-1]:.1%}, unmasked {float(metrics['tiles_unmasked']):.1%}")
  return state, losses, skipped


@contextlib.contextmanager
def _workdir(path: str | None):
  """`path`, or a temporary folder removed afterwards."""
  if path:
    yield Path(path)
    return
  with tempfile.TemporaryDirectory(prefix="bagel_grain_train_") as tmp:
    yield Path(tmp)


def _run_twice(args, train_step, init, new_data, ckpt_dir, log):
  """Losses of the uninterrupted run and of the checkpointed-and-resumed one; and the
  fraction of tiles skipped per step of the first."""
  log("-- uninterrupted run")
  data = new_data()
  try:
    _, losses, skipped = _train(train_step, init(), data, args.steps, log)
  finally:
    data.close()

  log(f"-- run to step {args.ckpt_step}, checkpoint, restart from it")
  shutil.rmtree(ckpt_dir, ignore_errors=True)  # this example's own folder, rebuilt each run
  manager = bgj.checkpoint_manager(str(ckpt_dir))
  try:
    data = new_data()
    try:
      state, first, _ = _train(train_step, init(), data, args.ckpt_step, log)
      bgj.save(manager, args.ckpt_step, state, data)
    finally:
      data.close()
    del state
    data = new_data()  # a fresh pipeline
    try:
      state = bgj.restore(manager, args.ckpt_step, init(), data)
      log(f"restored step {int(state['step'])}")
      _, rest, _ = _train(train_step, state, data, args.steps - args.ckpt_step, log)
    finally:
      data.close()
  finally:
    manager.close()
  return losses, first + rest, skipped


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", help="a config YAML (default: the package's demo.yaml on "
                      "--data)")
  parser.add_argument("--data", default=".demo_data",
                      help="the folder `bagel-grain make-sample-data` wrote")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--ckpt-step", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=None,
                      help="rows per process (default: this process's device count)")
  parser.add_argument("--workdir", default=None, help="default: a new temporary folder")
  parser.add_argument("--max-num-tokens", type=int, default=None,
                      help="shrink the row budget (L) for quick runs")
  parser.add_argument("--max-image-size", type=int, default=None,
                      help="cap every image transform's max_image_size for quick runs")
  parser.add_argument("--workers", type=int, default=0)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)
  if not 0 < args.ckpt_step < args.steps:
    parser.error("--ckpt-step must lie between 0 and --steps")
  return args


def main(argv=None) -> dict[str, Any]:
  args = parse_args(argv)
  log = (lambda *_: None) if args.quiet else print
  start = time.perf_counter()
  compiles_before = _BACKEND_COMPILES["total"]
  _BACKEND_COMPILES["steps"] = _BACKEND_COMPILES["in_later_steps"] = 0

  cfg = bagel_grain.load_config(args.config) if args.config else load_shipped("demo", args.data)
  cfg = shrink_config(cfg, max_num_tokens=args.max_num_tokens,
                      max_image_size=args.max_image_size)
  tokenizer = bagel_grain.load_tokenizer(cfg.tokenizer_path)
  batch_size = args.batch_size or jax.local_device_count()
  # Auto axes: jit propagates the batch sharding through the model (the helpers in
  # bagel_grain.jax are written for it; an Explicit mesh would need out_sharding on gathers).
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  mc = ModelConfig(vocab_size=tokenizer.vocab_size, patch_features=cfg.vit_patch_size ** 2 * 3,
                   vae_downsample=cfg.vae_image_downsample,
                   max_num_patch_per_side=cfg.max_num_patch_per_side,
                   max_latent_size=cfg.max_latent_size, dim=args.dim, layers=args.layers)
  traces = collections.Counter()
  train_step = make_train_step(mc, mesh, args.seed, traces)
  row_length = -(-cfg.max_num_tokens // 128) * 128  # the packer pads rows to 128
  block = tile_size(row_length)

  log(f"mesh {dict(mesh.shape)}, {batch_size} rows per process, global batch "
      f"{batch_size * jax.process_count()}, L = {cfg.max_num_tokens}, attention tiles "
      f"{block} x {block}")
  with _workdir(args.workdir) as workdir:
    ckpt_dir = workdir / "train_example_checkpoints"
    losses, resumed, skipped = _run_twice(
        args, train_step, lambda: init_state(mc, mesh, args.seed),
        lambda: _data(cfg, tokenizer, batch_size, mesh, args.workers), ckpt_dir, log)

  results = {
      "losses": losses,
      "resumed_losses": resumed,
      "final_loss": losses[-1],
      "resumed_final_loss": resumed[-1],
      "max_abs_loss_diff": float(np.max(np.abs(np.subtract(losses, resumed)))),
      "compiles": {"train_step": train_step._cache_size()},  # pylint: disable=protected-access
      "traces": dict(traces),
      # XLA compiles of everything (eager setup ops included), and those during any
      # train step but the first one of this run: 0 when shapes and shardings are static.
      "backend_compiles_total": _BACKEND_COMPILES["total"] - compiles_before,
      "backend_compiles_in_later_steps": _BACKEND_COMPILES["in_later_steps"],
      "global_batch": batch_size * jax.process_count(),
      "row_length": row_length,
      "devices": jax.device_count(),
      "attention_tile": block,
      # Of the batch's tile x tile blocks, the share no query sees: never visited.
      "tiles_skipped": round(float(np.mean(skipped)), 4),
      "checkpoint_dir": str(ckpt_dir) if args.workdir else None,  # a temporary one is removed
      "seconds": round(time.perf_counter() - start, 2),
  }
  log(json.dumps({k: v for k, v in results.items() if "losses" not in k}, indent=2))
  log(f"attention skipped {results['tiles_skipped']:.1%} of the {block} x {block} tiles "
      "(the mask rules them out)")
  return results


if __name__ == "__main__":
  out = main(sys.argv[1:])
  sys.exit(0 if out["max_abs_loss_diff"] == 0.0 and out["compiles"]["train_step"] == 1 else 1)
