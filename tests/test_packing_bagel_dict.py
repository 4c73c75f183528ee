"""to_bagel_dict on literal rows: each group of upstream's keys, present exactly when due."""

import numpy as np
import pytest

from bagel_grain.packed_row import PIXEL_VALUES
from bagel_grain.packing.bagel_dict import to_bagel_dict
from bagel_grain.packing.layout import Geometry, SpecialTokens, layout_sample
from bagel_grain.packing.row import Capacities, RowBuilder
from bagel_grain.sample import PlanItem

GEO = Geometry(vit_patch_size=2, vae_downsample=4, max_num_patch_per_side=10,
               max_latent_size=8, interpolate_pos=False)
TOK = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)
CAPS = Capacities(tokens=128, vit_patches=32, vae_tokens=32, vae_images=2, vae_image_size=8,
                  splits=16, vit_patch_size=2)


def row_of(*samples):
  """A row of samples, each (plan, texts, images, timesteps)."""
  builder = RowBuilder(CAPS)
  for plan, texts, images, steps in samples:
    builder.add(layout_sample(plan, [np.asarray(t, np.int32) for t in texts], images,
                              cfg_drops=[], timesteps=steps, geometry=GEO, special=TOK))
  return builder.build()


TEXT_ONLY = ([PlanItem("text"), PlanItem("text", loss=1)], [[50], [60, 61]], [], [])


def test_text_only_row_has_no_image_or_mse_keys():
  out = to_bagel_dict(row_of(TEXT_ONLY), use_flex=True)
  assert out["sequence_length"] == 7 and out["sample_lens"] == [7, 121]
  assert out["split_lens"] == [3, 4, 121] and out["attn_modes"] == ["causal"] * 3
  assert out["packed_text_ids"].tolist() == [1, 50, 2, 1, 60, 61, 2]
  # The loss text predicts its next tokens, each at weight 1/sqrt(3).
  assert out["ce_loss_indexes"].tolist() == [3, 4, 5]
  assert out["packed_label_ids"].tolist() == [60, 61, 2]
  np.testing.assert_allclose(out["ce_loss_weights"], 1 / np.sqrt(3), rtol=1e-6)
  assert not {"padded_images", "packed_vit_tokens", "packed_timesteps"} & set(out)


def test_flex_padding_split_even_when_empty_and_never_negative():
  row = row_of(TEXT_ONLY)
  assert to_bagel_dict(row, use_flex=True, pad_to=7)["split_lens"][-1] == 0
  with pytest.raises(ValueError, match="pad_to 6 is shorter than the row's 7 tokens"):
    to_bagel_dict(row, use_flex=True, pad_to=6)


def test_dense_masks_are_per_sample():
  vit = np.zeros((2, 4, 3), np.uint8)
  out = to_bagel_dict(row_of(TEXT_ONLY, ([PlanItem("vit_image")], [], [vit], [])),
                      use_flex=False)
  causal, full = out["nested_attention_masks"]
  assert causal.shape == (7, 7) and np.array_equal(causal[3:, 3:], np.tril(np.ones((4, 4))))
  assert not causal[:3, 3:].any()  # the first split does not see the second
  assert full.shape == (4, 4) and full.all()  # a ViT image's run sees itself whole
  assert out["vit_token_seqlens"].tolist() == [2]
  np.testing.assert_array_equal(out["packed_vit_tokens"], PIXEL_VALUES[np.zeros((2, 12), int)])


def test_vae_images_normalised_cropped_and_their_latents():
  small = np.full((4, 4, 3), 255, np.uint8)
  wide = np.zeros((4, 8, 3), np.uint8)
  out = to_bagel_dict(row_of(([PlanItem("vae_image", loss=1)], [], [small], [0.5]),
                             ([PlanItem("vae_image")], [], [wide], [])), use_flex=True)
  images = out["padded_images"]  # CHW, cropped to the largest height and width
  assert images.shape == (2, 3, 4, 8)
  assert (images[0, :, :, :4] == 1.0).all() and (images[0, :, :, 4:] == 0).all()
  assert (images[1] == -1.0).all()
  assert out["patchified_vae_latent_shapes"] == [(1, 1), (1, 2)]
  assert out["patchified_vae_latent_shapes"] == to_bagel_dict(
      row_of(([PlanItem("vae_image", loss=1)], [], [small], [0.5]),
             ([PlanItem("vae_image")], [], [wide], [])),
      use_flex=True, vae_downsample=4)["patchified_vae_latent_shapes"]
  assert out["packed_vae_token_indexes"].tolist() == [1, 4, 5]
  steps = out["packed_timesteps"]
  assert steps[0] == np.float32(0.5) and np.isneginf(steps[1:]).all()
  assert out["mse_loss_indexes"].tolist() == [1]
  assert out["attn_modes"][:2] == ["noise", "full"]
