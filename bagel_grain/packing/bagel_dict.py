"""Rebuilds upstream's `to_tensor()` dict from one packed row, for parity tests."""

from __future__ import annotations

import numpy as np

from bagel_grain.packing.attention import sample_mask
from bagel_grain.packing.layout import MODE_NAMES, TEXT
from bagel_grain.packing.row import PackedRow


def normalize_pixels(u8: np.ndarray) -> np.ndarray:
  """(u8/255 - 0.5)/0.5 in float32, the same operations as torchvision's path."""
  x = u8.astype(np.float32) / np.float32(255)
  return (x - np.float32(0.5)) / np.float32(0.5)


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
  num_samples = int(row["num_samples"])
  seg = row["segment_ids"][:n]
  sample_lens = np.bincount(seg, minlength=num_samples + 1)[1:].tolist()
  ttype = row["token_type"][:n]
  text_index = np.flatnonzero(ttype == TEXT)
  k = int(row["split_ids"][n - 1]) if n else 0
  split_lens = row["split_lens"][:k].tolist()
  split_modes = row["split_modes"][:k]
  out = {
      "sequence_length": n,
      "sample_lens": sample_lens,
      "packed_text_ids": row["text_ids"][text_index].astype(np.int64),
      "packed_text_indexes": text_index.astype(np.int64),
      "packed_position_ids": row["position_ids"][:n].astype(np.int64),
  }
  if use_flex:
    pad_to = row["text_ids"].shape[0] if pad_to is None else pad_to
    pad = pad_to - n
    if pad < 0:
      raise ValueError(f"pad_to {pad_to} is shorter than the row's {n} tokens")
    out["split_lens"] = split_lens + [pad]
    out["attn_modes"] = [MODE_NAMES[m] for m in split_modes] + ["causal"]
    out["sample_lens"] = sample_lens + [pad]
  else:
    starts = np.cumsum([0] + sample_lens[:-1])
    masks = []
    for s, ln in zip(starts.tolist(), sample_lens):
      if ln == 0:  # a sample whose items were all dropped
        masks.append(np.zeros((0, 0), bool))
        continue
      first, last = int(row["split_ids"][s]), int(row["split_ids"][s + ln - 1])
      masks.append(sample_mask(row["split_lens"][first - 1:last],
                               row["split_modes"][first - 1:last]))
    out["nested_attention_masks"] = masks

  num_images = int(np.count_nonzero(row["vae_image_hw"][:, 0]))
  t = int(row["num_vae_tokens"])
  vae_index = row["vae_token_index"][:t]
  if num_images:
    hw = row["vae_image_hw"][:num_images]
    max_h, max_w = (int(x) for x in hw.max(axis=0))
    images = row["vae_images"][:num_images, :max_h, :max_w]
    h_idx, w_idx = np.arange(max_h), np.arange(max_w)
    real = ((h_idx[None, :, None] < hw[:, 0, None, None])
            & (w_idx[None, None, :] < hw[:, 1, None, None]))
    padded = np.where(real[..., None], normalize_pixels(images), np.float32(0))
    out["padded_images"] = padded.transpose(0, 3, 1, 2)
    out["patchified_vae_latent_shapes"] = _latent_shapes(hw, vae_index, vae_downsample)
    out["packed_latent_position_ids"] = row["vae_latent_position_ids"][:t].astype(np.int64)
    out["packed_vae_token_indexes"] = vae_index.astype(np.int64)

  v = int(row["num_vit_tokens"])
  if v:
    img_ids = row["vit_image_ids"][:v]
    out["packed_vit_tokens"] = normalize_pixels(row["vit_patches"][:v])
    out["packed_vit_position_ids"] = row["vit_position_ids"][:v].astype(np.int64)
    out["packed_vit_token_indexes"] = row["vit_token_index"][:v].astype(np.int64)
    out["vit_token_seqlens"] = np.bincount(img_ids)[1:].astype(np.int64)

  if t:
    out["packed_timesteps"] = row["timesteps"][vae_index]
    out["mse_loss_indexes"] = np.flatnonzero(row["mse_mask"][:n]).astype(np.int64)

  ce_index = np.flatnonzero(row["ce_weights"][:n] > 0)
  if ce_index.size:
    out["packed_label_ids"] = row["label_ids"][ce_index].astype(np.int64)
    out["ce_loss_indexes"] = ce_index.astype(np.int64)
    out["ce_loss_weights"] = row["ce_weights"][ce_index]
  return out
