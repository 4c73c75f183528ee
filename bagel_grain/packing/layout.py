"""Layout of one sample in a packed sequence: BAGEL's `pack_sequence` for one sample."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from bagel_grain.packing import positions
from bagel_grain.sample import PlanItem

# Token types (DESIGN.md section 5).
PAD, TEXT, VIT, VAE = 0, 1, 2, 3
# Split attention modes, in the row's int8 encoding.
CAUSAL, FULL, NOISE = 0, 1, 2
MODE_NAMES = ("causal", "full", "noise")


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Patch and latent grid settings that shape a layout (upstream's data config)."""

  vit_patch_size: int
  vae_downsample: int
  max_num_patch_per_side: int
  max_latent_size: int
  interpolate_pos: bool


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Ids of the tokens the packer inserts (upstream names in the comments)."""

  bos: int  # bos_token_id = <|im_start|>
  eos: int  # eos_token_id = <|im_end|>
  start_of_image: int  # <|vision_start|>
  end_of_image: int  # <|vision_end|>


@dataclasses.dataclass(frozen=True, eq=False)
class SampleLayout:
  """One sample laid out as tokens; positions are relative to the sample's start.

  Per token (n): text_ids, token_type, position_ids, split_ids (1-based in the
  sample), label_ids, ce_weights, timesteps, mse_mask. Per split: split_lens,
  split_modes. Per ViT patch: vit_patches, vit_position_ids, vit_token_index,
  vit_image_ids (1-based in the sample). Per VAE latent: vae_latent_position_ids,
  vae_token_index; vae_images holds the kept VAE images in order.
  """

  text_ids: np.ndarray
  token_type: np.ndarray
  position_ids: np.ndarray
  split_ids: np.ndarray
  label_ids: np.ndarray
  ce_weights: np.ndarray
  timesteps: np.ndarray
  mse_mask: np.ndarray
  split_lens: np.ndarray
  split_modes: np.ndarray
  vit_patches: np.ndarray
  vit_position_ids: np.ndarray
  vit_token_index: np.ndarray
  vit_image_ids: np.ndarray
  vae_images: tuple[np.ndarray, ...]
  vae_latent_position_ids: np.ndarray
  vae_token_index: np.ndarray

  @property
  def num_tokens(self) -> int:
    return int(self.token_type.shape[0])

  @property
  def num_vit_tokens(self) -> int:
    return int(self.vit_token_index.shape[0])

  @property
  def num_vae_tokens(self) -> int:
    return int(self.vae_token_index.shape[0])

  @property
  def num_vae_images(self) -> int:
    return len(self.vae_images)

  @property
  def num_splits(self) -> int:
    return int(self.split_lens.shape[0])

  @property
  def max_vae_hw(self) -> tuple[int, int]:
    """Largest height and width over the VAE images: what an image slot must hold."""
    if not self.vae_images:
      return 0, 0
    return (max(im.shape[0] for im in self.vae_images),
            max(im.shape[1] for im in self.vae_images))


def draw_sample_choices(plan: Sequence[PlanItem], rng: np.random.Generator, *,
                        text_p: float, vit_p: float, vae_p: float
                        ) -> tuple[tuple[bool, ...], tuple[float, ...]]:
  """Draws a sample's conditioning-dropout decisions and flow-matching timesteps.

  Order of draws from `rng` (fixed, so the sample's key re-creates them):
  first `rng.random(c)`, one uniform per `enable_cfg=1` item in plan order (the
  item is dropped iff u < p for its type); then `rng.standard_normal(t)`, one
  timestep per VAE item with `loss=1` that starts a split and is not dropped, in
  plan order. Drawing all uniforms first keeps the dropout decisions independent
  of how many timesteps follow. Upstream draws the same quantities from Python's
  `random` and `np.random`.
  """
  probs = {"text": text_p, "vit_image": vit_p, "vae_image": vae_p}
  cfg_items = [it for it in plan if it.enable_cfg == 1]
  u = rng.random(len(cfg_items))
  drops = tuple(bool(x < probs[it.type]) for x, it in zip(u, cfg_items))
  dropped = iter(drops)
  num_t = 0
  for it in plan:
    is_dropped = next(dropped) if it.enable_cfg == 1 else False
    if it.type == "vae_image" and it.loss == 1 and it.split_start and not is_dropped:
      num_t += 1
  timesteps = tuple(float(x) for x in rng.standard_normal(num_t))
  return drops, timesteps


def patchify(image: np.ndarray, patch: int) -> np.ndarray:
  """uint8 HWC image -> [h*w, patch*patch*3], patches row-major, features (py, px, c)."""
  hh, ww, c = image.shape
  if hh % patch or ww % patch:
    raise ValueError(f"ViT image {hh}x{ww} is not a multiple of the patch size {patch}")
  h, w = hh // patch, ww // patch
  x = image.reshape(h, patch, w, patch, c).transpose(0, 2, 1, 3, 4)
  return x.reshape(h * w, patch * patch * c)


class _Parts:
  """Per-item chunks of every per-token field, concatenated once at the end."""

  def __init__(self):
    self.text_ids, self.token_type, self.position_ids, self.split_ids = [], [], [], []
    self.label_ids, self.ce_weights, self.timesteps, self.mse_mask = [], [], [], []
    self.length = 0

  def add(self, text_ids, token_type, position, split_id, labels=None, weights=None,
          timesteps=None, mse=None):
    n = len(token_type)
    self.text_ids.append(np.asarray(text_ids, np.int32))
    self.token_type.append(np.asarray(token_type, np.int8))
    self.position_ids.append(np.asarray(position, np.int32) + np.zeros(n, np.int32))
    self.split_ids.append(np.full(n, split_id, np.int32))
    self.label_ids.append(np.zeros(n, np.int32) if labels is None else labels)
    self.ce_weights.append(np.zeros(n, np.float32) if weights is None else weights)
    self.timesteps.append(np.zeros(n, np.float32) if timesteps is None else timesteps)
    self.mse_mask.append(np.zeros(n, bool) if mse is None else mse)
    self.length += n


def _cat(chunks, dtype, width=None):
  if not chunks:
    return np.zeros((0,) if width is None else (0, width), dtype)
  return np.concatenate(chunks).astype(dtype, copy=False)


def _marker_run(start: int, n: int, end: int) -> np.ndarray:
  """[start, 0 * n, end]: text ids of an image run (its patches/latents are not text)."""
  out = np.zeros(n + 2, np.int32)
  out[0], out[-1] = start, end
  return out


def layout_sample(plan: Sequence[PlanItem], text_ids: Sequence[np.ndarray],
                  images: Sequence[np.ndarray], *, cfg_drops: Sequence[bool],
                  timesteps: Sequence[float], geometry: Geometry,
                  special: SpecialTokens) -> SampleLayout:
  """Lays out one sample as upstream's `pack_sequence` would (DESIGN.md section 4).

  Pure: every random choice comes in `cfg_drops` (one per `enable_cfg=1` item, in
  plan order) and `timesteps` (in draw order; see `draw_sample_choices`). Text ids
  and images are consumed in plan order, including those of dropped items.
  Where upstream is undefined or broken (multi-item splits that hold text or ViT,
  a split whose start is dropped), the rules are: a split's mode comes from its
  first kept item, every item's RoPE ids use only its own length, a split closes
  at its `split_end` item even when that item is dropped, and a loss latent is
  noised (mse) only when its timestep is finite.
  """
  texts = iter(text_ids)
  imgs = iter(images)
  drops = iter(cfg_drops)
  steps = iter(timesteps)
  g = geometry
  parts = _Parts()
  split_lens: list[int] = []
  split_modes: list[int] = []
  vit_patches, vit_pos, vit_index, vit_img = [], [], [], []
  vae_images, vae_pos, vae_index = [], [], []
  rope = 0
  split_len, split_mode = 0, None
  split_t = -np.inf

  def close_split():
    nonlocal split_len, split_mode
    if split_len > 0:
      split_lens.append(split_len)
      split_modes.append(split_mode)
    split_len, split_mode = 0, None

  for item in plan:
    if item.split_start:
      close_split()
      split_t = -np.inf
    if item.type == "text":
      payload = next(texts)
    elif item.type in ("vit_image", "vae_image"):
      payload = next(imgs)
    else:
      raise ValueError(f"unknown plan item type {item.type!r}")
    dropped = bool(next(drops)) if item.enable_cfg == 1 else False
    if item.special_token_loss == 1 and item.special_token_label is None:
      raise ValueError("special_token_loss=1 needs a special_token_label")
    split_id = len(split_lens) + 1
    start = parts.length

    if item.type == "text":
      if not dropped:
        ids = np.asarray(payload, np.int32).reshape(-1)
        n = ids.shape[0]
        toks = np.concatenate([[special.bos], ids, [special.eos]]).astype(np.int32)
        labels = np.zeros(n + 2, np.int32)
        weights = np.zeros(n + 2, np.float32)
        if item.loss == 1:
          labels[:n + 1] = toks[1:]
          weights[:n + 1] = np.float32(1.0 / np.sqrt(n + 1.0))
        if item.special_token_loss == 1:
          labels[-1], weights[-1] = item.special_token_label, 1.0
        parts.add(toks, np.full(n + 2, TEXT, np.int8), rope + np.arange(n + 2), split_id,
                  labels, weights)
        rope += n + 2
        split_len += n + 2
        split_mode = CAUSAL if split_mode is None else split_mode

    elif item.type == "vit_image":
      if dropped:
        rope += 1
      else:
        image = np.asarray(payload, np.uint8)
        patches = patchify(image, g.vit_patch_size)
        v = patches.shape[0]
        ttype = np.full(v + 2, VIT, np.int8)
        ttype[[0, -1]] = TEXT
        labels, weights = _special_label(item, v + 2)
        parts.add(_marker_run(special.start_of_image, v, special.end_of_image), ttype,
                  rope, split_id, labels, weights)
        vit_patches.append(patches)
        vit_pos.append(positions.flattened_position_ids(
            image.shape[0], image.shape[1], g.vit_patch_size, g.max_num_patch_per_side,
            interpolate=g.interpolate_pos))
        vit_index.append(start + 1 + np.arange(v, dtype=np.int32))
        vit_img.append(np.full(v, len(vit_patches), np.int32))
        rope += 1
        split_len += v + 2
        split_mode = FULL if split_mode is None else split_mode

    else:  # vae_image
      if dropped:
        rope += 1
      else:
        image = np.asarray(payload, np.uint8)
        d = g.vae_downsample
        t = (image.shape[0] // d) * (image.shape[1] // d)
        if item.loss == 1:
          if item.split_start:
            split_t = next(steps, None)
            if split_t is None:
              raise ValueError("fewer timesteps given than the plan draws")
            split_t = float(split_t)
          t_value = split_t
        else:
          t_value = -np.inf
        ttype = np.full(t + 2, VAE, np.int8)
        ttype[[0, -1]] = TEXT
        tsteps = np.full(t + 2, t_value, np.float32)
        tsteps[[0, -1]] = 0.0
        mse = np.zeros(t + 2, bool)
        mse[1:-1] = item.loss == 1 and np.isfinite(t_value)
        labels, weights = _special_label(item, t + 2)
        parts.add(_marker_run(special.start_of_image, t, special.end_of_image), ttype,
                  rope, split_id, labels, weights, tsteps, mse)
        vae_images.append(image)
        vae_pos.append(positions.flattened_position_ids(
            image.shape[0], image.shape[1], d, g.max_latent_size,
            interpolate=g.interpolate_pos))
        vae_index.append(start + 1 + np.arange(t, dtype=np.int32))
        if item.frame_delta is not None:
          rope += item.frame_delta
        elif item.loss == 0:
          rope += 1
        split_len += t + 2
        if split_mode is None:
          noise = item.loss == 1 and item.frame_delta is None
          split_mode = NOISE if noise else FULL

    if item.split_end:
      close_split()
  close_split()
  if next(steps, None) is not None:
    raise ValueError("more timesteps given than the plan draws")

  p = g.vit_patch_size
  return SampleLayout(
      text_ids=_cat(parts.text_ids, np.int32),
      token_type=_cat(parts.token_type, np.int8),
      position_ids=_cat(parts.position_ids, np.int32),
      split_ids=_cat(parts.split_ids, np.int32),
      label_ids=_cat(parts.label_ids, np.int32),
      ce_weights=_cat(parts.ce_weights, np.float32),
      timesteps=_cat(parts.timesteps, np.float32),
      mse_mask=_cat(parts.mse_mask, bool),
      split_lens=np.asarray(split_lens, np.int32),
      split_modes=np.asarray(split_modes, np.int8),
      vit_patches=_cat(vit_patches, np.uint8, p * p * 3),
      vit_position_ids=_cat(vit_pos, np.int32),
      vit_token_index=_cat(vit_index, np.int32),
      vit_image_ids=_cat(vit_img, np.int32),
      vae_images=tuple(vae_images),
      vae_latent_position_ids=_cat(vae_pos, np.int32),
      vae_token_index=_cat(vae_index, np.int32),
  )


def _special_label(item: PlanItem, n: int) -> tuple[np.ndarray, np.ndarray]:
  """Labels/weights of an image run: only its end marker may carry a loss."""
  labels = np.zeros(n, np.int32)
  weights = np.zeros(n, np.float32)
  if item.special_token_loss == 1:
    labels[-1], weights[-1] = item.special_token_label, 1.0
  return labels, weights
