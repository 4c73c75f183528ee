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
- attention: a few pre-norm transformer layers under the packed mask, evaluated
  from per-key query intervals (`mask_block`);
- loss: CE on `label_ids` weighted by `ce_weights`, plus MSE of the predicted
  velocity `eps - x0` on `mse_mask` tokens.

    bagel-grain make-sample-data .demo_data
    python tools/train_example.py --data .demo_data --steps 8 --ckpt-step 4
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import bagel_grain
from bagel_grain import jax as bgj
from bagel_grain.config import PipelineConfig
from bagel_grain.configs import load_shipped
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


def attention_layer(p, h, mask, heads):
  b, length, d = h.shape
  x = rms_norm(h, p["norm1"])
  q, k, v = jnp.split(x @ p["qkv"], 3, -1)
  q, k, v = (t.reshape(b, length, heads, d // heads) for t in (q, k, v))
  scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // heads)
  # Padding queries see nothing: a finite fill keeps their softmax defined (no loss there).
  scores = jnp.where(mask[:, None], scores, -1e9)
  att = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, -1), v).reshape(b, length, d)
  h = h + att @ p["out"]
  x = rms_norm(h, p["norm2"])
  return h + jax.nn.gelu(x @ p["up"]) @ p["down"]


def loss_fn(params, batch, noise_key, mc: ModelConfig):
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
  q = jnp.arange(length)
  mask = bgj.mask_block(intervals, q[:, None], q[None, :])
  for layer in params["layers"]:
    h = attention_layer(layer, h, mask, mc.heads)
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
  return ce + mse, (ce, mse)


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
    (loss, (ce, mse)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], batch, noise_key, mc)
    return adam(state, grads), {"loss": loss, "ce": ce, "mse": mse}

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
  losses = []
  for _ in range(steps):
    batch = next(data)
    before = _BACKEND_COMPILES["total"]
    state, metrics = train_step(state, batch.arrays)
    losses.append(float(metrics["loss"]))
    _BACKEND_COMPILES["steps"] += 1
    if _BACKEND_COMPILES["steps"] > 1:  # any compile after the very first step is a recompile
      _BACKEND_COMPILES["in_later_steps"] += _BACKEND_COMPILES["total"] - before
    log(f"step {int(state['step']):3d}  loss {losses[-1]:.6f}  ce {float(metrics['ce']):.4f}  "
        f"mse {float(metrics['mse']):.4f}  rows {len(batch.sample_keys)}")
  return state, losses


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
  workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bagel_grain_train_"))
  ckpt_dir = workdir / "train_example_checkpoints"
  shutil.rmtree(ckpt_dir, ignore_errors=True)  # this example's own folder, rebuilt each run

  log(f"mesh {dict(mesh.shape)}, {batch_size} rows per process, global batch "
      f"{batch_size * jax.process_count()}, L = {cfg.max_num_tokens}")
  log("-- uninterrupted run")
  data = _data(cfg, tokenizer, batch_size, mesh, args.workers)
  try:
    _, losses = _train(train_step, init_state(mc, mesh, args.seed), data, args.steps, log)
  finally:
    data.close()

  log(f"-- run to step {args.ckpt_step}, checkpoint, restart from it")
  manager = bgj.checkpoint_manager(str(ckpt_dir))
  data = _data(cfg, tokenizer, batch_size, mesh, args.workers)
  try:
    state, first = _train(train_step, init_state(mc, mesh, args.seed), data, args.ckpt_step, log)
    bgj.save(manager, args.ckpt_step, state, data)
  finally:
    data.close()
  del state
  data = _data(cfg, tokenizer, batch_size, mesh, args.workers)  # a fresh pipeline
  try:
    state = bgj.restore(manager, args.ckpt_step, init_state(mc, mesh, args.seed), data)
    log(f"restored step {int(state['step'])}")
    state, rest = _train(train_step, state, data, args.steps - args.ckpt_step, log)
  finally:
    data.close()
    manager.close()

  resumed = first + rest
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
      "row_length": int(-(-cfg.max_num_tokens // 128) * 128),
      "devices": jax.device_count(),
      "checkpoint_dir": str(ckpt_dir),
      "seconds": round(time.perf_counter() - start, 2),
  }
  log(json.dumps({k: v for k, v in results.items() if "losses" not in k}, indent=2))
  return results


if __name__ == "__main__":
  out = main(sys.argv[1:])
  sys.exit(0 if out["max_abs_loss_diff"] == 0.0 and out["compiles"]["train_step"] == 1 else 1)
