"""On-device preparation of packed batches: pixel normalisation and token scatter/gather.

Rows reach the device as uint8 pixels and index arrays whose empty slots hold
the sentinel `L` (the row length). Everything here is shape-static and jittable;
scatters use `mode='drop'`, so sentinel slots write nowhere, and gathers mask
them out, so padding stays exactly 0.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from bagel_grain.packed_row import PIXEL_VALUES, TokenType


def normalize_pixels(pixels: jax.Array, valid: jax.Array, dtype=jnp.float32) -> jax.Array:
  """uint8 -> `(x/255 - 0.5)/0.5` in [-1, 1] where `valid` (broadcast), 0 elsewhere."""
  index = jnp.asarray(pixels).astype(jnp.int32)
  # The result is laid out like the pixels (explicit-sharding meshes ask for it).
  x = jnp.asarray(PIXEL_VALUES).at[index].get(out_sharding=jax.typeof(index).sharding)
  return jnp.where(valid, x, 0.0).astype(dtype)


def normalize_vit_patches(vit_patches: jax.Array, vit_token_index: jax.Array, seq_len: int,
                          dtype=jnp.float32) -> jax.Array:
  """[..., V, p*p*3] uint8 -> float; slots whose token index is the sentinel stay 0."""
  return normalize_pixels(vit_patches, (vit_token_index < seq_len)[..., None], dtype)


def normalize_vae_images(vae_images: jax.Array, vae_image_hw: jax.Array,
                         dtype=jnp.float32) -> jax.Array:
  """[..., I, S, S, 3] uint8 -> float; outside each image's real (h, w) stays 0."""
  size = vae_images.shape[-2]
  rows = jnp.arange(vae_images.shape[-3])
  cols = jnp.arange(size)
  h = vae_image_hw[..., 0, None, None]
  w = vae_image_hw[..., 1, None, None]
  valid = (rows[:, None] < h) & (cols[None, :] < w)  # [..., I, S, S]
  return normalize_pixels(vae_images, valid[..., None], dtype)


@functools.partial(jax.jit, static_argnames=("seq_len", "dtype"))
def _normalize_both(vit_patches, vit_token_index, vae_images, vae_image_hw, seq_len, dtype):
  return (normalize_vit_patches(vit_patches, vit_token_index, seq_len, dtype),
          normalize_vae_images(vae_images, vae_image_hw, dtype))


def prepare_pixels(batch: dict[str, Any], dtype=jnp.float32) -> dict[str, Any]:
  """The batch with `vit_patches` and `vae_images` normalised (docs/packed_row.md, "Pixels").

  The other fields pass through untouched. Jitted on its own; inside a jitted
  step it is simply traced along.
  """
  out = dict(batch)
  out["vit_patches"], out["vae_images"] = _normalize_both(
      batch["vit_patches"], batch["vit_token_index"], batch["vae_images"],
      batch["vae_image_hw"], seq_len=batch["text_ids"].shape[-1], dtype=dtype)
  return out


def scatter_tokens(sequence: jax.Array, tokens: jax.Array, token_index: jax.Array) -> jax.Array:
  """Writes tokens [B, N, D] at positions token_index [B, N] of sequence [B, L, D].

  Slots holding the sentinel `L` (or anything out of range) are dropped.
  """
  batch = jnp.arange(sequence.shape[0])[:, None]
  return sequence.at[batch, token_index].set(tokens.astype(sequence.dtype), mode="drop")


def gather_tokens(sequence: jax.Array, token_index: jax.Array) -> jax.Array:
  """Reads [B, N, D] from sequence [B, L, D] at token_index [B, N]; sentinel slots read 0."""
  batch = jnp.arange(sequence.shape[0])[:, None]
  return sequence.at[batch, token_index].get(mode="fill", fill_value=0)


def assemble_sequence(token_type: jax.Array, text_embeddings: jax.Array, vit_tokens: jax.Array,
                      vit_token_index: jax.Array, vae_tokens: jax.Array,
                      vae_token_index: jax.Array) -> jax.Array:
  """One [B, L, D] input sequence: text embeddings at text/marker positions, then the
  ViT [B, V, D] and VAE [B, T, D] tokens scattered to their positions; padding is 0."""
  text = jnp.where((token_type == TokenType.TEXT)[..., None], text_embeddings, 0)
  seq = scatter_tokens(text, vit_tokens, vit_token_index)
  return scatter_tokens(seq, vae_tokens, vae_token_index)


def vae_latent_grid_index(vae_image_hw: jax.Array, num_slots: int,
                          downsample: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Where each VAE latent-token slot comes from: (image, row, col, valid), each [B, T].

  Latent tokens are packed image after image, row-major over each image's
  `(h/d) x (w/d)` grid, in the order of `vae_images` (what BAGEL's `patchify`
  of each cropped latent produces). Slots past the last token are not valid.
  """
  hw = vae_image_hw // downsample
  counts = hw[..., 0] * hw[..., 1]  # [B, I]
  ends = jnp.cumsum(counts, axis=-1)
  slot = jnp.arange(num_slots, dtype=ends.dtype)
  image = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(ends)
  valid = slot[None, :] < ends[..., -1:]
  image = jnp.minimum(image, counts.shape[-1] - 1)
  start = jnp.take_along_axis(ends - counts, image, axis=-1)
  width = jnp.maximum(jnp.take_along_axis(hw[..., 1], image, axis=-1), 1)
  offset = slot[None, :] - start
  return image, offset // width, offset % width, valid


def gather_vae_latents(latents: jax.Array, vae_image_hw: jax.Array, num_slots: int,
                       downsample: int) -> jax.Array:
  """Per-image latent grids [B, I, H, W, C] -> the row's latent tokens [B, T, C] (0 when empty).

  `latents` is what a VAE encoder gives for the padded `vae_images` (or any
  stand-in on the same grid); each image's top-left `(h/d, w/d)` crop is read.
  """
  image, row, col, valid = vae_latent_grid_index(vae_image_hw, num_slots, downsample)
  batch = jnp.arange(latents.shape[0])[:, None]
  tokens = latents[batch, image, row, col]
  return jnp.where(valid[..., None], tokens, 0)
