"""Dense reference attention masks (may-attend) for one sample and for a packed row."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bagel_grain.packed_row import MODE_NAMES, SplitMode

_MODE_CODES = {name: code for code, name in enumerate(MODE_NAMES)}


def mode_codes(modes: Sequence[int | str] | np.ndarray) -> np.ndarray:
  """Split modes as int8 codes; accepts upstream's names or the codes themselves."""
  modes = list(modes) if not isinstance(modes, np.ndarray) else modes
  if len(modes) and isinstance(modes[0], str):
    return np.asarray([_MODE_CODES[m] for m in modes], np.int8)
  return np.asarray(modes, np.int8).reshape(-1)


def _rule(q_seg, k_seg, q_split, k_split, k_mode, k_pos_le_q):
  """docs/packed_row.md, "Attention": same sample and (causal or own full/noise split), and
  never a noise split's keys from outside that split."""
  same_split = q_split == k_split
  open_split = (k_mode == SplitMode.FULL) | (k_mode == SplitMode.NOISE)
  allowed = (q_seg == k_seg) & (k_pos_le_q | (same_split & open_split))
  return allowed & ~((k_mode == SplitMode.NOISE) & ~same_split)


def sample_mask(split_lens: Sequence[int] | np.ndarray,
                split_modes: Sequence[int | str] | np.ndarray) -> np.ndarray:
  """bool [n, n], [q, k] True where query q may attend key k, for one sample."""
  lens = np.asarray(split_lens, np.int64).reshape(-1)
  modes = mode_codes(split_modes)
  n = int(lens.sum())
  split = np.repeat(np.arange(lens.shape[0]), lens)
  mode = modes[split]
  pos = np.arange(n)
  return _rule(0, 0, split[:, None], split[None, :], mode[None, :],
               pos[None, :] <= pos[:, None])


def row_mask(segment_ids: np.ndarray, split_ids: np.ndarray,
             split_modes_per_split: np.ndarray) -> np.ndarray:
  """bool [L, L] may-attend mask of a packed row; padding (segment 0) sees nothing.

  `split_ids` are 1-based row split numbers indexing `split_modes_per_split`.
  """
  seg = np.asarray(segment_ids).reshape(-1)
  split = np.asarray(split_ids).reshape(-1)
  modes = mode_codes(split_modes_per_split)
  real = seg > 0
  mode = np.where(real, modes[np.maximum(split - 1, 0)], SplitMode.CAUSAL)
  pos = np.arange(seg.shape[0])
  allowed = _rule(seg[:, None], seg[None, :], split[:, None], split[None, :],
                  mode[None, :], pos[None, :] <= pos[:, None])
  return allowed & real[:, None] & real[None, :]
