"""Attention masks of packed rows on the device: dense reference, per-key intervals, block map.

The rule (docs/packed_row.md, "Attention"): query q may see key k iff same sample (segment > 0)
and (k <= q or same split and the split is full/noise) and not (k is noise and
k's split is not q's split).

Because samples and splits are contiguous runs of a packed row, every key column
of that mask is one contiguous run of queries: key k is seen by exactly the
queries in `[first_query[k], last_query[k]]`, where

- `first_query = split start` when k's split is full or noise, else `k` itself;
- `last_query = split end` when k's split is noise (nobody outside sees it),
  else the end of k's sample;
- padding keys get the empty interval `[L, -1]`.

Two int32 arrays per row describe the whole mask, so a kernel can evaluate any
tile from index arrays (`mask_block`) and `block_summary` can classify tiles
from per-chunk minima and maxima, never materialising L x L.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bagel_grain.packed_row import SplitMode

EMPTY_BLOCK, PARTIAL_BLOCK, FULL_BLOCK = 0, 1, 2


def token_split_modes(split_ids: jax.Array, split_modes: jax.Array) -> jax.Array:
  """Per-token split mode [..., L] (causal on padding) from per-split modes [..., K]."""
  index = jnp.maximum(split_ids - 1, 0)
  mode = jnp.take_along_axis(split_modes.astype(jnp.int32), index, axis=-1)
  return jnp.where(split_ids > 0, mode, SplitMode.CAUSAL)


def dense_mask(segment_ids: jax.Array, split_ids: jax.Array,
               split_modes: jax.Array) -> jax.Array:
  """bool [..., L, L] may-attend mask, [q, k], straight from the rule (reference; small L)."""
  seg, split = segment_ids, split_ids
  mode = token_split_modes(split_ids, split_modes)
  pos = jnp.arange(seg.shape[-1])
  same_seg = (seg[..., :, None] == seg[..., None, :]) & (seg[..., :, None] > 0)
  same_split = split[..., :, None] == split[..., None, :]
  k_mode = mode[..., None, :]
  open_split = (k_mode == SplitMode.FULL) | (k_mode == SplitMode.NOISE)
  causal = pos[None, :] <= pos[:, None]
  allowed = same_seg & (causal | (same_split & open_split))
  return allowed & ~((k_mode == SplitMode.NOISE) & ~same_split)


class KeyIntervals(NamedTuple):
  """Per key k: the queries `[first_query[k], last_query[k]]` that may see it ([..., L] int32)."""

  first_query: jax.Array
  last_query: jax.Array


def _run_bounds(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Start and end (inclusive) of the run of equal ids each position belongs to."""
  length = ids.shape[-1]
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
  changed = ids[..., 1:] != ids[..., :-1]
  first = jnp.concatenate([jnp.ones_like(changed[..., :1]), changed], axis=-1)
  last = jnp.concatenate([changed, jnp.ones_like(changed[..., :1])], axis=-1)
  start = lax.cummax(jnp.where(first, pos, 0), axis=pos.ndim - 1)
  end = lax.cummin(jnp.where(last, pos, length), axis=pos.ndim - 1, reverse=True)
  return start, end


def key_intervals(segment_ids: jax.Array, split_ids: jax.Array,
                  split_modes: jax.Array) -> KeyIntervals:
  """The mask of each row as per-key query intervals (see the module docstring).

  Assumes what the packer guarantees: each sample and each split is one
  contiguous run of positions, and split ids differ between samples.
  """
  length = segment_ids.shape[-1]
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
  mode = token_split_modes(split_ids, split_modes)
  split_start, split_end = _run_bounds(split_ids)
  _, seg_end = _run_bounds(segment_ids)
  real = segment_ids > 0
  first = jnp.where(mode == SplitMode.CAUSAL, pos, split_start)
  last = jnp.where(mode == SplitMode.NOISE, split_end, seg_end)
  return KeyIntervals(jnp.where(real, first, length).astype(jnp.int32),
                      jnp.where(real, last, -1).astype(jnp.int32))


def mask_block(intervals: KeyIntervals, q_index: jax.Array, k_index: jax.Array) -> jax.Array:
  """The mask at (q_index, k_index) (broadcastable int arrays): what a kernel computes per tile.

  The result has the intervals' leading (batch) dims followed by the broadcast
  shape of the index arrays.
  """
  lead = intervals.first_query.shape[:-1]
  first = jnp.take(intervals.first_query, k_index, axis=-1)
  last = jnp.take(intervals.last_query, k_index, axis=-1)
  q = jnp.reshape(q_index, (1,) * len(lead) + jnp.shape(q_index))
  return (first <= q) & (q <= last)


def block_summary(intervals: KeyIntervals, block_q: int, block_k: int) -> jax.Array:
  """int8 [..., L/block_q, L/block_k]: 0 no query sees any key, 2 all see all, 1 otherwise.

  Exact, from minima and maxima of the key intervals over chunks of
  g = gcd(block_q, block_k) keys: a chunk lies wholly before, inside or after a
  query block, and then "some key's interval meets [q0, q1]" reduces to
  `min(first) <= q1 and max(last) >= q0` (each key's own position lies in its
  interval). A tile is full iff `max(first) <= q0 and min(last) >= q1`.
  """
  first, last = intervals
  length = first.shape[-1]
  if length % block_q or length % block_k:
    raise ValueError(f"block sizes {block_q}, {block_k} must divide the row length {length}")
  g = math.gcd(block_q, block_k)
  lead = first.shape[:-1]
  chunks = (*lead, length // g, g)
  first_c, last_c = first.reshape(chunks), last.reshape(chunks)
  min_first, max_first = first_c.min(-1), first_c.max(-1)
  min_last, max_last = last_c.min(-1), last_c.max(-1)
  q0 = jnp.arange(0, length, block_q, dtype=jnp.int32)[:, None]
  q1 = q0 + block_q - 1
  e = (..., None, slice(None))
  some = (min_first[e] <= q1) & (max_last[e] >= q0)  # [..., nq, chunks]
  every = (max_first[e] <= q0) & (min_last[e] >= q1)
  per_block = (*lead, length // block_q, length // block_k, block_k // g)
  some = some.reshape(per_block).any(-1)
  every = every.reshape(per_block).all(-1)
  return jnp.where(every, FULL_BLOCK, jnp.where(some, PARTIAL_BLOCK, EMPTY_BLOCK)).astype(
      jnp.int8)


def splash_mask(intervals_row, num_heads: int = 1):
  """A splash-attention `MultiHeadMask` for one row (host numpy intervals), all heads alike.

  Splash kernels take static masks, processed on the host when the kernel is
  built, so this fits inspection and fixed-layout evaluation rather than a
  training loop over changing rows (there, pass the intervals to a kernel that
  evaluates `mask_block` per tile). Needs `jax.experimental.pallas`.
  """
  # pylint: disable=import-outside-toplevel,protected-access
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sam

  first = np.asarray(intervals_row[0], np.int32)
  last = np.asarray(intervals_row[1], np.int32)
  if first.ndim != 1:
    raise ValueError("splash_mask takes the intervals of one row")
  identity = (first.tobytes(), last.tobytes())

  class IntervalMask(sam._ComputableMask):
    """Key k is visible to queries [first[k], last[k]]."""

    def __eq__(self, other):
      return isinstance(other, IntervalMask) and hash(self) == hash(other)

    def __hash__(self):
      return hash(identity)

  def visible(q, k):
    return (first[k] <= q) & (q <= last[k])

  length = first.shape[0]
  return sam.MultiHeadMask([IntervalMask((length, length), visible) for _ in range(num_heads)])
