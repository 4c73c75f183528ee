"""Attention masks against upstream's per-sample masks, and the row mask's block structure."""

from __future__ import annotations

import numpy as np
import pytest

from bagel_grain.packing.attention import mode_codes, row_mask, sample_mask
from golden import GOLDEN, load_json

MASKS = load_json("masks.json")["cases"]
NPZ = np.load(GOLDEN / "masks.npz")


@pytest.mark.parametrize("case", MASKS, ids=[c["name"] for c in MASKS])
def test_sample_mask_matches_upstream(case):
  want = NPZ[case["name"]]
  got = sample_mask(case["split_lens"], case["attn_modes"])
  assert got.dtype == bool and np.array_equal(got, want)
  # Integer mode codes give the same mask.
  assert np.array_equal(sample_mask(case["split_lens"], mode_codes(case["attn_modes"])), want)


def _row_fields(cases, length):
  """segment_ids, split_ids (row-global) and per-split modes for samples packed in order."""
  seg, split, modes = [], [], []
  for s, case in enumerate(cases, start=1):
    lens = case["split_lens"]
    seg.append(np.full(sum(lens), s))
    split.append(np.repeat(np.arange(len(modes) + 1, len(modes) + 1 + len(lens)), lens))
    modes.extend(mode_codes(case["attn_modes"]).tolist())
  seg, split = np.concatenate(seg), np.concatenate(split)
  pad = length - seg.shape[0]
  return (np.pad(seg, (0, pad)).astype(np.int32), np.pad(split, (0, pad)).astype(np.int32),
          np.asarray(modes + [0] * 3, np.int8))


@pytest.mark.parametrize("start", [0, 5, 17, 30])
def test_row_mask_is_block_diagonal_of_sample_masks(start):
  cases = MASKS[start:start + 6]
  n = sum(sum(c["split_lens"]) for c in cases)
  length = n + 11
  seg, split, modes = _row_fields(cases, length)
  got = row_mask(seg, split, modes)
  want = np.zeros((length, length), bool)
  off = 0
  for c in cases:
    m = NPZ[c["name"]]
    want[off:off + m.shape[0], off:off + m.shape[0]] = m
    off += m.shape[0]
  assert np.array_equal(got, want)
  assert not got[n:].any() and not got[:, n:].any()
