"""Rebuilds upstream's `to_tensor()` dict from one packed row, for parity tests."""

from __future__ import annotations

import numpy as np

from bagel_grain.packed_row import MODE_NAMES, PIXEL_VALUES, PackedRow, TokenType
from bagel_grain.packing.attention import sample_mask


def _latent_shapes(hw: np.ndarray, vae_index: np.ndarray,
                   vae_downsample: int | None) -> list[tuple[int, int]]:
  """Latent (h, w) per image; without a stride, find the one matching the token counts.

  Each image's latents are one contiguous run of positions (markers separate
  images), so the runs give the token count of every image.
  """
  if vae_downsample is not None:
    return [(int(h) // vae_downsample, int(w) // vae_downsample) for h, w in hw]
  breaks = np.flatnonzero(np.diff(vae_index) != 1) + 1
  counts = np.diff(np.concatenate([[0], breaks, [vae_index.shape[0]]]))
  if counts.shape[0] != hw.shape[0]:
    raise ValueError("cannot derive the VAE stride: token runs do not match images")
  out = []
  for (h, w), c in zip(hw.tolist(), counts.tolist()):
    guess = int(round(np.sqrt(h * w / c)))
    found = [d for d in range(max(1, guess - 2), guess + 3) if (h // d) * (w // d) == c]
    if not found:
      raise ValueError(f"cannot derive the VAE stride of a {h}x{w} image with {c} tokens")
    out.append((h // found[0], w // found[0]))
  return out


def to_bagel_dict(row: PackedRow, *, use_flex: bool, pad_to: int | None = None,
                  vae_downsample: int | None = None) -> dict:
  """Upstream's unpadded `to_tensor()` dict for one row (numpy/list stand-ins).

  With `use_flex`, a final causal padding split of `pad_to - sequence_length`
  tokens (default `pad_to` = L) is appended to split_lens, attn_modes and
  sample_lens, even when it is 0; without it, per-sample dense may-attend masks.
  Optional groups of keys appear exactly when upstream would add them.
  """
  n = int(row["num_tokens"])
  sample_lens = np.bincount(row["segment_ids"][:n],
                            minlength=int(row["num_samples"]) + 1)[1:].tolist()
  text_index = np.flatnonzero(row["token_type"][:n] == TokenType.TEXT)
  out = {
      "sequence_length": n,
      "sample_lens": sample_lens,
      "packed_text_ids": row["text_ids"][text_index].astype(np.int64),
      "packed_text_indexes": text_index.astype(np.int64),
      "packed_position_ids": row["position_ids"][:n].astype(np.int64),
  }
  if use_flex:
    out.update(_flex_splits(row, sample_lens, pad_to))
  else:
    out["nested_attention_masks"] = _sample_masks(row, sample_lens)
  out.update(_vae_fields(row, vae_downsample))
  out.update(_vit_fields(row))
  out.update(_loss_fields(row))
  return out


def _flex_splits(row: PackedRow, sample_lens: list[int], pad_to: int | None) -> dict:
  """Splits, modes and sample lengths with the final causal padding split."""
  n = int(row["num_tokens"])
  k = int(row["split_ids"][n - 1]) if n else 0
  pad_to = row["text_ids"].shape[0] if pad_to is None else pad_to
  pad = pad_to - n
  if pad < 0:
    raise ValueError(f"pad_to {pad_to} is shorter than the row's {n} tokens")
  return {"split_lens": row["split_lens"][:k].tolist() + [pad],
          "attn_modes": [MODE_NAMES[m] for m in row["split_modes"][:k]] + ["causal"],
          "sample_lens": sample_lens + [pad]}


def _sample_masks(row: PackedRow, sample_lens: list[int]) -> list[np.ndarray]:
  """Each sample's dense may-attend mask, from its own splits."""
  masks = []
  for s, ln in zip(np.cumsum([0] + sample_lens[:-1]).tolist(), sample_lens):
    if ln == 0:  # a sample whose items were all dropped
      masks.append(np.zeros((0, 0), bool))
      continue
    first, last = int(row["split_ids"][s]), int(row["split_ids"][s + ln - 1])
    masks.append(sample_mask(row["split_lens"][first - 1:last],
                             row["split_modes"][first - 1:last]))
  return masks


def _vae_fields(row: PackedRow, vae_downsample: int | None) -> dict:
  """Normalised images, CHW and cropped to the largest image, and their latent tokens."""
  num_images = int(np.count_nonzero(row["vae_image_hw"][:, 0]))
  if not num_images:
    return {}
  t = int(row["num_vae_tokens"])
  vae_index = row["vae_token_index"][:t]
  hw = row["vae_image_hw"][:num_images]
  max_h, max_w = (int(x) for x in hw.max(axis=0))
  images = row["vae_images"][:num_images, :max_h, :max_w]
  h_idx, w_idx = np.arange(max_h), np.arange(max_w)
  real = ((h_idx[None, :, None] < hw[:, 0, None, None])
          & (w_idx[None, None, :] < hw[:, 1, None, None]))
  padded = np.where(real[..., None], PIXEL_VALUES[images], np.float32(0))
  return {"padded_images": padded.transpose(0, 3, 1, 2),
          "patchified_vae_latent_shapes": _latent_shapes(hw, vae_index, vae_downsample),
          "packed_latent_position_ids": row["vae_latent_position_ids"][:t].astype(np.int64),
          "packed_vae_token_indexes": vae_index.astype(np.int64)}


def _vit_fields(row: PackedRow) -> dict:
  v = int(row["num_vit_tokens"])
  if not v:
    return {}
  return {"packed_vit_tokens": PIXEL_VALUES[row["vit_patches"][:v]],
          "packed_vit_position_ids": row["vit_position_ids"][:v].astype(np.int64),
          "packed_vit_token_indexes": row["vit_token_index"][:v].astype(np.int64),
          "vit_token_seqlens": np.bincount(row["vit_image_ids"][:v])[1:].astype(np.int64)}


def _loss_fields(row: PackedRow) -> dict:
  """Flow-matching timesteps and MSE positions; CE labels, positions and weights."""
  n, t = int(row["num_tokens"]), int(row["num_vae_tokens"])
  out = {}
  if t:
    out["packed_timesteps"] = row["timesteps"][row["vae_token_index"][:t]]
    out["mse_loss_indexes"] = np.flatnonzero(row["mse_mask"][:n]).astype(np.int64)
  ce_index = np.flatnonzero(row["ce_weights"][:n] > 0)
  if ce_index.size:
    out["packed_label_ids"] = row["label_ids"][ce_index].astype(np.int64)
    out["ce_loss_indexes"] = ce_index.astype(np.int64)
    out["ce_loss_weights"] = row["ce_weights"][ce_index]
  return out
