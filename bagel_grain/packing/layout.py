"""Layout of one sample in a packed sequence: BAGEL's `pack_sequence` for one sample."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from bagel_grain.packed_row import SplitMode, TokenType
from bagel_grain.packing import positions
from bagel_grain.sample import PlanItem, SpecialTokens


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Patch and latent grid settings that shape a layout (upstream's data config)."""

  vit_patch_size: int
  vae_downsample: int
  max_num_patch_per_side: int
  max_latent_size: int
  interpolate_pos: bool


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

  @property
  def nbytes(self) -> int:
    """Bytes of its arrays (pixels included): what the sample holds while it waits."""
    return sum(a.nbytes for a in (*(getattr(self, f.name) for f in dataclasses.fields(self)
                                     if f.name != "vae_images"), *self.vae_images))


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


def concat(arrays: Sequence[np.ndarray], dtype, tail: tuple[int, ...] = ()) -> np.ndarray:
  """One array of `dtype` from `arrays` joined on axis 0 (an empty [0, *tail] when none)."""
  if not arrays:
    return np.zeros((0, *tail), dtype)
  return np.concatenate(arrays).astype(dtype, copy=False)


@dataclasses.dataclass(frozen=True, eq=False)
class ItemTokens:
  """One kept plan item laid out, per token from its first token, and its image arrays.

  `patches`/`patch_position_ids` are set for a ViT image, `image`/`latent_position_ids`
  for a VAE image; an image's tokens are its run minus the two markers.
  """

  text_ids: np.ndarray
  token_type: np.ndarray
  position_ids: np.ndarray
  label_ids: np.ndarray
  ce_weights: np.ndarray
  timesteps: np.ndarray
  mse_mask: np.ndarray
  mode: SplitMode  # the mode of a split this item starts
  patches: np.ndarray | None = None
  patch_position_ids: np.ndarray | None = None
  image: np.ndarray | None = None
  latent_position_ids: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return int(self.token_type.shape[0])


def _item_labels(item: PlanItem, n: int) -> tuple[np.ndarray, np.ndarray]:
  """Labels/weights of an image run: only its end marker may carry a loss."""
  labels = np.zeros(n, np.int32)
  weights = np.zeros(n, np.float32)
  if item.special_token_loss == 1:
    labels[-1], weights[-1] = item.special_token_label, 1.0
  return labels, weights


def _image_run(kind: TokenType, n: int, special: SpecialTokens) -> tuple[np.ndarray, np.ndarray]:
  """Text ids and token types of an image's run: [start marker, n image tokens, end marker]."""
  text_ids = np.zeros(n + 2, np.int32)
  text_ids[0], text_ids[-1] = special.start_of_image, special.end_of_image
  token_type = np.full(n + 2, kind, np.int8)
  token_type[[0, -1]] = TokenType.TEXT
  return text_ids, token_type


def text_tokens(ids: np.ndarray, item: PlanItem, rope: int,
                special: SpecialTokens) -> ItemTokens:
  """A text item: bos, its ids, eos at RoPE rope, rope+1, ...; with `loss`, each token
  predicts the next at weight 1/sqrt(n+1); the eos may carry a special label."""
  ids = np.asarray(ids, np.int32).reshape(-1)
  n = ids.shape[0]
  toks = np.concatenate([[special.bos], ids, [special.eos]]).astype(np.int32)
  labels = np.zeros(n + 2, np.int32)
  weights = np.zeros(n + 2, np.float32)
  if item.loss == 1:
    labels[:n + 1] = toks[1:]
    weights[:n + 1] = np.float32(1.0 / np.sqrt(n + 1.0))
  if item.special_token_loss == 1:
    labels[-1], weights[-1] = item.special_token_label, 1.0
  return ItemTokens(
      text_ids=toks, token_type=np.full(n + 2, TokenType.TEXT, np.int8),
      position_ids=(rope + np.arange(n + 2)).astype(np.int32), label_ids=labels,
      ce_weights=weights, timesteps=np.zeros(n + 2, np.float32),
      mse_mask=np.zeros(n + 2, bool), mode=SplitMode.CAUSAL)


def vit_tokens(image: np.ndarray, item: PlanItem, rope: int, geometry: Geometry,
               special: SpecialTokens) -> ItemTokens:
  """A ViT image: its patches between two markers, all at RoPE `rope`, in a full split."""
  image = np.asarray(image, np.uint8)
  patches = patchify(image, geometry.vit_patch_size)
  v = patches.shape[0]
  text_ids, token_type = _image_run(TokenType.VIT, v, special)
  labels, weights = _item_labels(item, v + 2)
  return ItemTokens(
      text_ids=text_ids, token_type=token_type, position_ids=np.full(v + 2, rope, np.int32),
      label_ids=labels, ce_weights=weights, timesteps=np.zeros(v + 2, np.float32),
      mse_mask=np.zeros(v + 2, bool), mode=SplitMode.FULL, patches=patches,
      patch_position_ids=positions.flattened_position_ids(
          image.shape[0], image.shape[1], geometry.vit_patch_size,
          geometry.max_num_patch_per_side, interpolate=geometry.interpolate_pos))


def vae_tokens(image: np.ndarray, item: PlanItem, rope: int, timestep: float,
               geometry: Geometry, special: SpecialTokens) -> ItemTokens:
  """A VAE image: its latents between two markers, all at RoPE `rope`.

  `timestep` goes to every latent (-inf: a clean image); the latents are noised
  (mse) when the item has a loss and the timestep is finite. A noised image that
  is not a video frame makes its split a noise split, else a full one.
  """
  image = np.asarray(image, np.uint8)
  d = geometry.vae_downsample
  t = (image.shape[0] // d) * (image.shape[1] // d)
  text_ids, token_type = _image_run(TokenType.VAE, t, special)
  timesteps = np.full(t + 2, timestep, np.float32)
  timesteps[[0, -1]] = 0.0
  mse = np.zeros(t + 2, bool)
  mse[1:-1] = item.loss == 1 and np.isfinite(timestep)
  labels, weights = _item_labels(item, t + 2)
  noise = item.loss == 1 and item.frame_delta is None
  return ItemTokens(
      text_ids=text_ids, token_type=token_type, position_ids=np.full(t + 2, rope, np.int32),
      label_ids=labels, ce_weights=weights, timesteps=timesteps, mse_mask=mse,
      mode=SplitMode.NOISE if noise else SplitMode.FULL, image=image,
      latent_position_ids=positions.flattened_position_ids(
          image.shape[0], image.shape[1], d, geometry.max_latent_size,
          interpolate=geometry.interpolate_pos))


def next_rope(item: PlanItem, rope: int, tokens: ItemTokens | None) -> int:
  """The RoPE position after an item (`tokens` None when it was dropped).

  A text advances by its length (0 when dropped); any image by 1, except a kept
  VAE image: by its `frame_delta` (a video frame), or by 0 when it takes a loss
  (the noised image and what follows share a position).
  """
  if item.type == "text":
    return rope + (0 if tokens is None else tokens.num_tokens)
  if tokens is None or item.type == "vit_image":
    return rope + 1
  if item.frame_delta is not None:
    return rope + item.frame_delta
  return rope + (1 if item.loss == 0 else 0)


class _SampleParts:
  """The laid-out items of one sample, and its attention splits, joined at the end."""

  def __init__(self):
    self.items: list[ItemTokens] = []
    self.starts: list[int] = []  # each item's first position in the sample
    self.length = 0
    self.split_lens: list[int] = []
    self.split_modes: list[SplitMode] = []
    self.split_ids: list[np.ndarray] = []
    self._split_len, self._split_mode = 0, None

  def add(self, tokens: ItemTokens) -> None:
    n = tokens.num_tokens
    self.items.append(tokens)
    self.starts.append(self.length)
    self.split_ids.append(np.full(n, len(self.split_lens) + 1, np.int32))
    self.length += n
    self._split_len += n
    if self._split_mode is None:  # a split's mode comes from its first kept item
      self._split_mode = tokens.mode

  def close_split(self) -> None:
    if self._split_len > 0:
      self.split_lens.append(self._split_len)
      self.split_modes.append(self._split_mode)
    self._split_len, self._split_mode = 0, None

  def layout(self, patch_width: int) -> SampleLayout:
    items = self.items
    vit = [(x, s) for x, s in zip(items, self.starts) if x.patches is not None]
    vae = [(x, s) for x, s in zip(items, self.starts) if x.image is not None]
    return SampleLayout(
        text_ids=concat([x.text_ids for x in items], np.int32),
        token_type=concat([x.token_type for x in items], np.int8),
        position_ids=concat([x.position_ids for x in items], np.int32),
        split_ids=concat(self.split_ids, np.int32),
        label_ids=concat([x.label_ids for x in items], np.int32),
        ce_weights=concat([x.ce_weights for x in items], np.float32),
        timesteps=concat([x.timesteps for x in items], np.float32),
        mse_mask=concat([x.mse_mask for x in items], bool),
        split_lens=np.asarray(self.split_lens, np.int32),
        split_modes=np.asarray(self.split_modes, np.int8),
        vit_patches=concat([x.patches for x, _ in vit], np.uint8, (patch_width,)),
        vit_position_ids=concat([x.patch_position_ids for x, _ in vit], np.int32),
        vit_token_index=concat([_inner_positions(x, s) for x, s in vit], np.int32),
        vit_image_ids=concat([np.full(len(x.patches), i + 1, np.int32)
                              for i, (x, _) in enumerate(vit)], np.int32),
        vae_images=tuple(x.image for x, _ in vae),
        vae_latent_position_ids=concat([x.latent_position_ids for x, _ in vae], np.int32),
        vae_token_index=concat([_inner_positions(x, s) for x, s in vae], np.int32),
    )


def _inner_positions(tokens: ItemTokens, start: int) -> np.ndarray:
  """Sample positions of an image's tokens: its run without the two markers."""
  return start + 1 + np.arange(tokens.num_tokens - 2, dtype=np.int32)


def layout_sample(plan: Sequence[PlanItem], text_ids: Sequence[np.ndarray],
                  images: Sequence[np.ndarray], *, cfg_drops: Sequence[bool],
                  timesteps: Sequence[float], geometry: Geometry,
                  special: SpecialTokens) -> SampleLayout:
  """Lays out one sample as upstream's `pack_sequence` would (docs/design.md, section 5).

  Pure: every random choice comes in `cfg_drops` (one per `enable_cfg=1` item, in
  plan order) and `timesteps` (in draw order; see `draw_sample_choices`). Text ids
  and images are consumed in plan order, including those of dropped items.
  Where upstream is undefined or broken (multi-item splits that hold text or ViT,
  a split whose start is dropped), the rules are: a split's mode comes from its
  first kept item, every item's RoPE ids use only its own length, a split closes
  at its `split_end` item even when that item is dropped, and a loss latent is
  noised (mse) only when its timestep is finite.
  """
  texts, imgs, drops, steps = iter(text_ids), iter(images), iter(cfg_drops), iter(timesteps)
  parts = _SampleParts()
  rope = 0
  split_t = -np.inf  # the timestep of the current split's noised images
  for item in plan:
    if item.type not in ("text", "vit_image", "vae_image"):
      raise ValueError(f"unknown plan item type {item.type!r}")
    if item.special_token_loss == 1 and item.special_token_label is None:
      raise ValueError("special_token_loss=1 needs a special_token_label")
    if item.split_start:
      parts.close_split()
      split_t = -np.inf
    payload = next(texts) if item.type == "text" else next(imgs)
    dropped = bool(next(drops)) if item.enable_cfg == 1 else False
    if not dropped and item.type == "vae_image" and item.loss == 1 and item.split_start:
      split_t = _next_timestep(steps)
    tokens = None if dropped else _item_tokens(item, payload, rope, split_t, geometry, special)
    if tokens is not None:
      parts.add(tokens)
    rope = next_rope(item, rope, tokens)
    if item.split_end:
      parts.close_split()
  parts.close_split()
  if next(steps, None) is not None:
    raise ValueError("more timesteps given than the plan draws")
  return parts.layout(3 * geometry.vit_patch_size**2)


def _item_tokens(item: PlanItem, payload: np.ndarray, rope: int, split_t: float,
                 geometry: Geometry, special: SpecialTokens) -> ItemTokens:
  if item.type == "text":
    return text_tokens(payload, item, rope, special)
  if item.type == "vit_image":
    return vit_tokens(payload, item, rope, geometry, special)
  timestep = split_t if item.loss == 1 else -np.inf
  return vae_tokens(payload, item, rope, timestep, geometry, special)


def _next_timestep(steps) -> float:
  step = next(steps, None)
  if step is None:
    raise ValueError("fewer timesteps given than the plan draws")
  return float(step)
