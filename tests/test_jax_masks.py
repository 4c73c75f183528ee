"""Device attention masks: the dense reference and the interval form against upstream's
golden masks and the numpy row mask; the block summary against the dense mask."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bagel_grain.jax import attention
from bagel_grain.packing.attention import mode_codes, row_mask
from bagel_grain.pipeline import build_pipeline
from golden import GOLDEN, load_json

MASKS = load_json("masks.json")["cases"]
NPZ = np.load(GOLDEN / "masks.npz")


def one_sample_rows(cases, length):
  """segment/split ids and per-split modes: one sample per row, then padding."""
  seg = np.zeros((len(cases), length), np.int32)
  split = np.zeros((len(cases), length), np.int32)
  modes = np.zeros((len(cases), max(len(c["split_lens"]) for c in cases) + 3), np.int8)
  for row, case in enumerate(cases):
    lens = case["split_lens"]
    n = sum(lens)
    seg[row, :n] = 1
    split[row, :n] = np.repeat(np.arange(1, len(lens) + 1), lens)
    modes[row, :len(lens)] = mode_codes(case["attn_modes"])
  return seg, split, modes


dense_mask = jax.jit(attention.dense_mask)
key_intervals = jax.jit(attention.key_intervals)


@jax.jit
def full_mask_from_intervals(intervals):
  q = jnp.arange(intervals.first_query.shape[-1])
  return attention.mask_block(intervals, q[:, None], q[None, :])


@pytest.fixture(scope="module")
def golden_rows():
  """All golden cases as one batch of rows (one shape, one compile)."""
  length = max(NPZ[c["name"]].shape[0] for c in MASKS) + 7
  seg, split, modes = one_sample_rows(MASKS, length)
  return (np.asarray(dense_mask(seg, split, modes)),
          np.asarray(full_mask_from_intervals(key_intervals(seg, split, modes))))


@pytest.mark.parametrize("index", range(len(MASKS)), ids=[c["name"] for c in MASKS])
def test_dense_and_interval_masks_match_upstream(golden_rows, index):
  want = NPZ[MASKS[index]["name"]]
  n = want.shape[0]
  for masks in golden_rows:
    got = masks[index]
    assert got.dtype == bool
    assert np.array_equal(got[:n, :n], want)
    assert not got[n:].any() and not got[:, n:].any()  # padding sees and is seen by nothing


def random_rows(rng, batch, length):
  """Packed-row attention fields: samples of random splits and modes, then padding."""
  segs, splits, modes = [], [], []
  max_splits = length
  for _ in range(batch):
    seg = np.zeros(length, np.int32)
    split = np.zeros(length, np.int32)
    split_modes = np.zeros(max_splits, np.int8)
    pos, sample, k = 0, 0, 0
    fill = rng.integers(0, length + 1)
    while pos < fill:
      sample += 1
      for _ in range(rng.integers(1, 5)):
        n = int(min(rng.integers(1, 20), length - pos))
        if n <= 0:
          break
        k += 1
        seg[pos:pos + n], split[pos:pos + n] = sample, k
        split_modes[k - 1] = rng.integers(0, 3)
        pos += n
    segs.append(seg)
    splits.append(split)
    modes.append(split_modes)
  return np.stack(segs), np.stack(splits), np.stack(modes)


BLOCKS = [(16, 16), (32, 16), (16, 32), (8, 24), (24, 8), (12, 32), (96, 96), (1, 1)]


@pytest.mark.parametrize("block_q,block_k", BLOCKS)
def test_block_summary_agrees_with_dense_mask(block_q, block_k):
  length = 96
  seg, split, modes = random_rows(np.random.default_rng(block_q * 100 + block_k), 24, length)
  dense = np.asarray(dense_mask(seg, split, modes))
  intervals = key_intervals(seg, split, modes)
  assert np.array_equal(full_mask_from_intervals(intervals), dense)
  summary = np.asarray(attention.block_summary(intervals, block_q, block_k))
  nq, nk = length // block_q, length // block_k
  tiles = dense.reshape(-1, nq, block_q, nk, block_k)
  assert summary.dtype == np.int8 and summary.shape == (24, nq, nk)
  assert np.array_equal(summary == attention.EMPTY_BLOCK, ~tiles.any(axis=(2, 4)))
  assert np.array_equal(summary == attention.FULL_BLOCK, tiles.all(axis=(2, 4)))
  assert set(np.unique(summary)) <= {0, 1, 2}


def test_block_summary_rejects_blocks_that_do_not_divide_the_row():
  intervals = attention.key_intervals(*(jnp.zeros((1, 96), jnp.int32),) * 2,
                                      jnp.zeros((1, 8), jnp.int8))
  with pytest.raises(ValueError, match="divide"):
    attention.block_summary(intervals, 64, 16)


def test_masks_on_demo_rows_equal_the_numpy_row_mask(demo_config, demo_tokenizer):
  cfg = dataclasses.replace(demo_config, expected_num_tokens=1536, max_num_tokens=2048,
                            max_num_tokens_per_sample=1536, prefer_buffer_before=768)
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=0))
  try:
    batch = next(it)
  finally:
    it.close()
  seg, split, modes = batch["segment_ids"], batch["split_ids"], batch["split_modes"]
  length = seg.shape[-1]
  dense = np.asarray(dense_mask(seg, split, modes))
  intervals = key_intervals(seg, split, modes)
  from_intervals = np.asarray(full_mask_from_intervals(intervals))
  summary = np.asarray(attention.block_summary(intervals, 256, 128))
  tiles = dense.reshape(2, length // 256, 256, length // 128, 128)
  for b in range(2):
    want = row_mask(seg[b], split[b], modes[b])
    assert np.array_equal(dense[b], want)
    assert np.array_equal(from_intervals[b], want)
  assert np.array_equal(summary == 0, ~tiles.any(axis=(2, 4)))
  assert np.array_equal(summary == 2, tiles.all(axis=(2, 4)))
  assert (summary == 1).any() and (summary == 0).any()


def test_splash_mask_adapter_matches_the_dense_mask():
  pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
  seg, split, modes = random_rows(np.random.default_rng(7), 1, 128)
  intervals = attention.key_intervals(seg[0], split[0], modes[0])
  mha = attention.splash_mask((np.asarray(intervals[0]), np.asarray(intervals[1])),
                              num_heads=2)
  want = np.asarray(attention.dense_mask(seg[0], split[0], modes[0]))
  assert mha.shape == (2, 128, 128)
  assert np.array_equal(mha[1, 0:64, 32:96], want[0:64, 32:96])
  assert np.array_equal(mha[0, :, :], want)
