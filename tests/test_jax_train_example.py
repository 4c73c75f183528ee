"""tools/train_example.py end to end: one compile of the train step, and resuming from an
Orbax checkpoint (model + iterator) reaches the loss of the uninterrupted run; its
tile-by-tile attention against the dense mask."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from bagel_grain import SplitMode
from bagel_grain import jax as bgj
from bagel_grain.jax.attention import EMPTY_BLOCK, FULL_BLOCK, PARTIAL_BLOCK

CAUSAL, FULL, NOISE = SplitMode.CAUSAL, SplitMode.FULL, SplitMode.NOISE

ROOT = Path(__file__).resolve().parents[1]


def load_train_example():
  path = ROOT / "tools" / "train_example.py"
  spec = importlib.util.spec_from_file_location("train_example", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_train_example_compiles_once_and_resumes_exactly(demo_dir, tmp_path):
  raw = yaml.safe_load((ROOT / "bagel_grain" / "configs" / "demo.yaml").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  config = tmp_path / "demo.yaml"
  config.write_text(yaml.safe_dump(raw))

  results = load_train_example().main([
      "--config", str(config), "--steps", "3", "--ckpt-step", "1", "--batch-size", "8",
      "--max-num-tokens", "512", "--max-image-size", "64", "--workdir", str(tmp_path),
      "--quiet"])

  assert results["devices"] == 8 and results["global_batch"] == 8
  assert results["compiles"]["train_step"] == 1
  assert results["traces"]["train_step"] == 1  # the resumed run reused the compiled step
  assert results["backend_compiles_in_later_steps"] == 0
  assert len(results["losses"]) == len(results["resumed_losses"]) == 3
  assert results["resumed_final_loss"] == results["final_loss"]
  assert results["max_abs_loss_diff"] == 0.0
  assert (tmp_path / "train_example_checkpoints" / "1" / "data").is_dir()
  assert results["attention_tile"] == 256 and 0 < results["tiles_skipped"] < 1


def test_without_a_workdir_the_temporary_folder_is_removed():
  with load_train_example()._workdir(None) as workdir:
    (workdir / "train_example_checkpoints").mkdir()
    assert workdir.is_dir()
  assert not workdir.exists()


# -- the example's attention: tile by tile equals the dense reference -------------

def _split_layout(rows):
  """segment_ids, split_ids, split_modes [b, L] / [b, K] from per-row lists of
  (sample, mode, length) splits, padded with zeros."""
  length = 128
  seg = np.zeros((len(rows), length), np.int32)
  split = np.zeros((len(rows), length), np.int32)
  modes = np.zeros((len(rows), 16), np.int32)
  for r, splits in enumerate(rows):
    at = 0
    for s, (sample, mode, n) in enumerate(splits):
      seg[r, at:at + n], split[r, at:at + n], modes[r, s] = sample, s + 1, mode
      at += n
  return seg, split, modes


def _dense_attention(q, k, v, mask):
  """Softmax attention under a [b, L, L] mask; queries that see nothing get zeros."""
  scores = jnp.einsum("bhqc,bhkc->bhqk", q, k) / np.sqrt(q.shape[-1])
  scores = jnp.where(mask[:, None], scores, -jnp.inf)
  sees = mask.any(-1)[:, None, :, None]
  p = jax.nn.softmax(jnp.where(sees, scores, 0.0), -1)
  return jnp.where(sees, jnp.einsum("bhqk,bhkc->bhqc", p, v), 0.0)


def test_tiled_attention_matches_the_dense_mask_values_and_gradients():
  example = load_train_example()

  seg, split, modes = map(jnp.asarray, _split_layout([
      # three samples: causal text, a full (ViT) split, a noise (VAE) split; then padding
      [(1, CAUSAL, 10), (1, FULL, 30), (1, NOISE, 20), (1, CAUSAL, 5), (2, CAUSAL, 20),
       (2, FULL, 17), (3, NOISE, 9)],
      # one long full split: whole tiles that every query sees
      [(1, FULL, 64), (1, CAUSAL, 40), (2, CAUSAL, 3)],
  ]))
  block = 32
  intervals = bgj.key_intervals(seg, split, modes)
  summary = bgj.block_summary(intervals, block, block)
  assert {EMPTY_BLOCK, PARTIAL_BLOCK, FULL_BLOCK} <= set(np.unique(summary).tolist())

  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, d_out = (jax.random.normal(key, (2, 3, 128, 8)) for key in keys)
  mask = bgj.dense_mask(seg, split, modes)

  def tiled(q, k, v):
    return example.tiled_attention(q, k, v, intervals, summary, block)

  def dense(q, k, v):
    return _dense_attention(q, k, v, mask)

  np.testing.assert_allclose(jax.jit(tiled)(q, k, v), dense(q, k, v), atol=1e-5, rtol=1e-5)
  for argnum in range(3):
    grad = lambda f: jax.grad(lambda *x: jnp.sum(f(*x) * d_out), argnums=argnum)(q, k, v)
    np.testing.assert_allclose(jax.jit(lambda: grad(tiled))(), grad(dense), atol=1e-4,
                               rtol=1e-4, err_msg=f"gradient of input {argnum}")
  padding = ~np.asarray(mask).any(-1)  # queries that see nothing: zeros, not NaN
  assert padding.any() and (np.asarray(tiled(q, k, v)).transpose(0, 2, 1, 3)[padding] == 0).all()
