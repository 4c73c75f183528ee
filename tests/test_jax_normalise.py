"""On-device preparation: pixel normalisation keeps padding at 0; scatters drop the L sentinel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bagel_grain.jax import prepare


def test_pixel_values_map_to_minus_one_plus_one():
  x = jnp.asarray([0, 51, 127, 128, 255], jnp.uint8)
  # Bit-exact with upstream's float32 arithmetic, eagerly and under jit.
  want = (np.asarray(x, np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
  for fn in (prepare.normalize_pixels, jax.jit(prepare.normalize_pixels)):
    got = np.asarray(fn(x, True))
    assert got.dtype == np.float32 and np.array_equal(got, want)
  assert got[0] == -1.0 and got[-1] == 1.0
  assert prepare.normalize_pixels(x, True, jnp.bfloat16).dtype == jnp.bfloat16


def test_vit_patch_slots_with_the_sentinel_stay_zero():
  length = 8
  patches = np.full((1, 4, 6), 255, np.uint8)  # all white, even the empty slots
  index = np.array([[2, 3, length, length]], np.int32)
  got = np.asarray(prepare.normalize_vit_patches(patches, index, length))
  assert (got[0, :2] == 1.0).all() and (got[0, 2:] == 0.0).all()


def test_vae_images_are_cropped_to_their_real_size():
  images = np.zeros((1, 3, 32, 32, 3), np.uint8)  # black: -1 where real, 0 where padding
  hw = np.array([[[32, 16], [16, 32], [0, 0]]], np.int32)
  got = np.asarray(prepare.normalize_vae_images(images, hw))
  assert (got[0, 0, :, :16] == -1).all() and (got[0, 0, :, 16:] == 0).all()
  assert (got[0, 1, :16] == -1).all() and (got[0, 1, 16:] == 0).all()
  assert (got[0, 2] == 0).all()


def test_prepare_pixels_normalises_both_pixel_fields_and_keeps_the_rest():
  length = 4
  batch = {
      "text_ids": np.zeros((1, length), np.int32),
      "vit_patches": np.full((1, 2, 3), 255, np.uint8),
      "vit_token_index": np.array([[1, length]], np.int32),
      "vae_images": np.full((1, 1, 16, 16, 3), 255, np.uint8),
      "vae_image_hw": np.array([[[16, 8]]], np.int32),
  }
  out = prepare.prepare_pixels(batch)
  assert np.array_equal(np.asarray(out["vit_patches"])[0, :, 0], [1.0, 0.0])
  vae = np.asarray(out["vae_images"])
  assert (vae[0, 0, :, :8] == 1).all() and (vae[0, 0, :, 8:] == 0).all()
  assert out["text_ids"] is batch["text_ids"]


def test_scatter_ignores_sentinel_slots_and_gather_reads_zero_there():
  length, dim = 6, 2
  seq = jnp.zeros((2, length, dim))
  tokens = jnp.arange(2 * 3 * dim, dtype=jnp.float32).reshape(2, 3, dim) + 1
  index = jnp.asarray([[1, 4, length], [length, length, 0]])
  out = np.asarray(prepare.scatter_tokens(seq, tokens, index))
  want = np.zeros((2, length, dim))
  want[0, 1], want[0, 4], want[1, 0] = tokens[0, 0], tokens[0, 1], tokens[1, 2]
  assert np.array_equal(out, want)
  back = np.asarray(prepare.gather_tokens(jnp.asarray(out), index))
  assert np.array_equal(back[0, :2], tokens[0, :2]) and (back[0, 2] == 0).all()
  assert (back[1, :2] == 0).all() and np.array_equal(back[1, 2], tokens[1, 2])


def test_assemble_sequence_places_text_vit_and_vae_tokens():
  length = 7
  token_type = jnp.asarray([[1, 2, 2, 1, 3, 1, 0]], jnp.int8)
  text = jnp.ones((1, length, 1))
  vit = jnp.asarray([[[20.0], [21.0], [99.0]]])
  vae = jnp.asarray([[[30.0], [99.0]]])
  seq = prepare.assemble_sequence(token_type, text, vit, jnp.asarray([[1, 2, length]]), vae,
                                  jnp.asarray([[4, length]]))
  assert np.asarray(seq)[0, :, 0].tolist() == [1, 20, 21, 1, 30, 1, 0]


def test_vae_latent_tokens_are_gathered_image_by_image_row_major():
  d = 2
  hw = np.array([[[4, 6], [2, 2], [0, 0]]], np.int32)  # grids 2x3 and 1x1
  latents = np.zeros((1, 3, 3, 3, 1), np.float32)
  latents[0, 0, :2, :3, 0] = [[1, 2, 3], [4, 5, 6]]
  latents[0, 1, 0, 0, 0] = 7
  latents[0, 0, 2, :, 0] = latents[0, 2, ..., 0] = 99  # outside the real grids
  got = np.asarray(prepare.gather_vae_latents(jnp.asarray(latents), jnp.asarray(hw), 9, d))
  assert got[0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0]
