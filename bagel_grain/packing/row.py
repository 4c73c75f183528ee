"""Fixed-capacity packed rows: capacities, usage accounting and the row builder."""

from __future__ import annotations

import dataclasses

import numpy as np

from bagel_grain.packing.layout import SampleLayout

# A packed row: exactly the fields of DESIGN.md section 5, static shapes.
PackedRow = dict[str, np.ndarray]

ROW_FIELDS = (
    "text_ids", "token_type", "position_ids", "segment_ids", "split_ids",
    "split_lens", "split_modes", "label_ids", "ce_weights", "timesteps", "mse_mask",
    "vit_patches", "vit_position_ids", "vit_token_index", "vit_image_ids",
    "vae_images", "vae_image_hw", "vae_latent_position_ids", "vae_token_index",
    "num_tokens", "num_vit_tokens", "num_vae_tokens", "num_samples",
)


@dataclasses.dataclass(frozen=True)
class Usage:
  """What a row (or one sample) occupies, in the units of `Capacities`."""

  tokens: int = 0
  vit_patches: int = 0
  vae_tokens: int = 0
  vae_images: int = 0
  splits: int = 0
  vae_image_size: int = 0  # largest VAE image side: a maximum, not a sum

  @classmethod
  def of(cls, layout: SampleLayout) -> Usage:
    return cls(layout.num_tokens, layout.num_vit_tokens, layout.num_vae_tokens,
               layout.num_vae_images, layout.num_splits, max(layout.max_vae_hw))

  def __add__(self, other: Usage) -> Usage:
    return Usage(self.tokens + other.tokens, self.vit_patches + other.vit_patches,
                 self.vae_tokens + other.vae_tokens, self.vae_images + other.vae_images,
                 self.splits + other.splits,
                 max(self.vae_image_size, other.vae_image_size))


@dataclasses.dataclass(frozen=True)
class Capacities:
  """Static slot counts of a packed row; every batch has these shapes (one compile).

  tokens L (a multiple of 128), vit_patches V, vae_tokens T, vae_images I of
  vae_image_size S x S pixels, splits K; vit_patch_size p sets the ViT patch
  width p*p*3.
  """

  tokens: int
  vit_patches: int
  vae_tokens: int
  vae_images: int
  vae_image_size: int
  splits: int
  vit_patch_size: int = 14

  def __post_init__(self):
    if self.tokens <= 0 or self.tokens % 128:
      raise ValueError(f"tokens capacity must be a positive multiple of 128, got {self.tokens}")
    for f in dataclasses.fields(self):
      if getattr(self, f.name) < 0:
        raise ValueError(f"capacity {f.name} must be >= 0")

  def overflows(self, usage: Usage) -> tuple[str, ...]:
    """Names of the capacities `usage` exceeds (empty when it fits): drop reasons."""
    out = []
    for name in ("tokens", "vit_patches", "vae_tokens", "vae_images", "splits",
                 "vae_image_size"):
      if getattr(usage, name) > getattr(self, name):
        out.append(name)
    return tuple(out)

  def fits(self, used: Usage, layout: SampleLayout) -> bool:
    """Whether `layout` can join a row that already holds `used`."""
    return not self.overflows(used + Usage.of(layout))

  def row_nbytes(self) -> int:
    """Host bytes of one packed row with these capacities."""
    return sum(a.nbytes for a in empty_row(self).values())


def default_capacities(max_num_tokens: int, vae_max_image_size: int, vae_stride: int,
                       min_vae_tokens_per_image: int, vit_patch_size: int, *,
                       max_vae_images: int = 16) -> Capacities:
  """Capacities derived from the token budget and the image transforms.

  - L = max_num_tokens rounded up to 128.
  - V = T = L: every ViT patch and VAE latent occupies a sequence position, so
    these can never be the binding limit.
  - I = clip(L // (min_vae_tokens_per_image + 2), 1, max_vae_images): as many VAE
    images as the smallest ones (plus their two markers) could fill, capped
    because each slot costs S*S*3 bytes.
  - S = vae_max_image_size rounded up to vae_stride (the resize may overshoot the
    max by less than a stride).
  - K = L // 2: every split holds at least two tokens (text: bos + eos).

  Memory per row, with p = vit_patch_size:
  L*30 (per-token fields) + V*(3p^2 + 12) + T*8 + I*(3*S^2 + 8) + K*5 bytes.
  Example: L = 32768, p = 14, S = 1024, I = 16: 0.94 + 18.75 + 0.25 + 48 + 0.08
  = about 68 MiB (one 1024 x 1024 slot is 3 MiB; the image slots dominate, so
  lower `max_vae_images` or S first when memory is tight).
  """
  tokens = -(-max_num_tokens // 128) * 128
  per_image = max(1, min_vae_tokens_per_image) + 2
  images = int(np.clip(tokens // per_image, 1, max_vae_images))
  size = -(-vae_max_image_size // vae_stride) * vae_stride
  return Capacities(tokens=tokens, vit_patches=tokens, vae_tokens=tokens,
                    vae_images=images, vae_image_size=size, splits=tokens // 2,
                    vit_patch_size=vit_patch_size)


def empty_row(caps: Capacities, batch: tuple[int, ...] = ()) -> PackedRow:
  """A row (or `batch` rows) with no samples: zeros, `L` in the token-index sentinels."""
  L, V, T, I, S, K = (caps.tokens, caps.vit_patches, caps.vae_tokens, caps.vae_images,
                      caps.vae_image_size, caps.splits)
  p = caps.vit_patch_size
  return {
      "text_ids": np.zeros((*batch, L), np.int32),
      "token_type": np.zeros((*batch, L), np.int8),
      "position_ids": np.zeros((*batch, L), np.int32),
      "segment_ids": np.zeros((*batch, L), np.int32),
      "split_ids": np.zeros((*batch, L), np.int32),
      "split_lens": np.zeros((*batch, K), np.int32),
      "split_modes": np.zeros((*batch, K), np.int8),
      "label_ids": np.zeros((*batch, L), np.int32),
      "ce_weights": np.zeros((*batch, L), np.float32),
      "timesteps": np.zeros((*batch, L), np.float32),
      "mse_mask": np.zeros((*batch, L), bool),
      "vit_patches": np.zeros((*batch, V, p * p * 3), np.uint8),
      "vit_position_ids": np.zeros((*batch, V), np.int32),
      "vit_token_index": np.full((*batch, V), L, np.int32),
      "vit_image_ids": np.zeros((*batch, V), np.int32),
      "vae_images": np.zeros((*batch, I, S, S, 3), np.uint8),
      "vae_image_hw": np.zeros((*batch, I, 2), np.int32),
      "vae_latent_position_ids": np.zeros((*batch, T), np.int32),
      "vae_token_index": np.full((*batch, T), L, np.int32),
      "num_tokens": np.zeros(batch, np.int32),
      "num_vit_tokens": np.zeros(batch, np.int32),
      "num_vae_tokens": np.zeros(batch, np.int32),
      "num_samples": np.zeros(batch, np.int32),
  }


def _cat(arrays, dtype, shape_tail=()):
  if not arrays:
    return np.zeros((0, *shape_tail), dtype)
  return np.concatenate(arrays).astype(dtype, copy=False)


class RowBuilder:
  """Accumulates sample layouts for one row and writes them into static arrays.

  It only enforces capacities; which samples go in (token budgets, buffering)
  is the packer's decision.
  """

  def __init__(self, capacities: Capacities):
    self.capacities = capacities
    self.reset()

  def reset(self) -> None:
    """Empties the builder for the next row."""
    self._layouts: list[SampleLayout] = []
    self._usage = Usage()

  @property
  def usage(self) -> Usage:
    return self._usage

  @property
  def used_tokens(self) -> int:
    return self._usage.tokens

  @property
  def num_samples(self) -> int:
    return len(self._layouts)

  @property
  def layouts(self) -> tuple[SampleLayout, ...]:
    return tuple(self._layouts)

  def overflows(self, layout: SampleLayout) -> tuple[str, ...]:
    """Capacities that adding `layout` would exceed (empty when it fits)."""
    return self.capacities.overflows(self._usage + Usage.of(layout))

  def fits(self, layout: SampleLayout) -> bool:
    return not self.overflows(layout)

  def add(self, layout: SampleLayout) -> None:
    over = self.overflows(layout)
    if over:
      raise ValueError(f"sample does not fit the row: exceeds {', '.join(over)}")
    self._layouts.append(layout)
    self._usage = self._usage + Usage.of(layout)

  def build(self, out: PackedRow | None = None, b: int = 0) -> PackedRow:
    """The row's arrays: each field is one concatenation and one slice assignment.

    With `out` (an empty batch from `empty_row(caps, (B,))`) the row is written in
    place as row `b`: pixels are copied once, straight into the batch.
    """
    caps = self.capacities
    if out is None:
      row = empty_row(caps)
    else:  # views of row b; a (1,)-slice reshaped keeps even the counts writable
      row = {name: array[b:b + 1].reshape(array.shape[1:]) for name, array in out.items()}
    lays = self._layouts
    u = self._usage
    n, v, t, k = u.tokens, u.vit_patches, u.vae_tokens, u.splits
    lens = [x.num_tokens for x in lays]
    tok_off = np.cumsum([0] + lens[:-1]).astype(np.int32)
    split_off = np.cumsum([0] + [x.num_splits for x in lays[:-1]]).astype(np.int32)
    vit_img_off = np.cumsum(
        [0] + [int(x.vit_image_ids.max(initial=0)) for x in lays[:-1]]).astype(np.int32)

    for name, dtype in (("text_ids", np.int32), ("token_type", np.int8),
                        ("position_ids", np.int32), ("label_ids", np.int32),
                        ("ce_weights", np.float32), ("timesteps", np.float32),
                        ("mse_mask", bool)):
      row[name][:n] = _cat([getattr(x, name) for x in lays], dtype)
    row["segment_ids"][:n] = np.repeat(np.arange(1, len(lays) + 1, dtype=np.int32), lens)
    row["split_ids"][:n] = _cat([x.split_ids + o for x, o in zip(lays, split_off)], np.int32)
    row["split_lens"][:k] = _cat([x.split_lens for x in lays], np.int32)
    row["split_modes"][:k] = _cat([x.split_modes for x in lays], np.int8)

    start = 0
    for x in lays:  # straight into the slots: the largest field, copied once
      row["vit_patches"][start:start + len(x.vit_patches)] = x.vit_patches
      start += len(x.vit_patches)
    row["vit_position_ids"][:v] = _cat([x.vit_position_ids for x in lays], np.int32)
    row["vit_token_index"][:v] = _cat(
        [x.vit_token_index + o for x, o in zip(lays, tok_off)], np.int32)
    row["vit_image_ids"][:v] = _cat(
        [x.vit_image_ids + o for x, o in zip(lays, vit_img_off)], np.int32)

    images = [im for x in lays for im in x.vae_images]
    for i, im in enumerate(images):
      row["vae_images"][i, :im.shape[0], :im.shape[1]] = im
    if images:
      row["vae_image_hw"][:len(images)] = [im.shape[:2] for im in images]
    row["vae_latent_position_ids"][:t] = _cat(
        [x.vae_latent_position_ids for x in lays], np.int32)
    row["vae_token_index"][:t] = _cat(
        [x.vae_token_index + o for x, o in zip(lays, tok_off)], np.int32)

    row["num_tokens"][...] = n
    row["num_vit_tokens"][...] = v
    row["num_vae_tokens"][...] = t
    row["num_samples"][...] = len(lays)
    return row
