"""inspect_row: a packed row as a PNG (bands, mask, thumbnails) and a text summary."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from bagel_grain.tooling.inspect_row import (LEGEND, axis_ticks, inspect_row, vae_images,
                                            vit_images)
from bagel_grain.packing.layout import patchify
from bagel_grain.packing.positions import flattened_position_ids
from bagel_grain.pipeline import build_pipeline


def test_vit_images_are_rebuilt_from_patches_and_position_ids():
  rng = np.random.default_rng(0)
  first = rng.integers(0, 256, (28, 42, 3), dtype=np.uint8)
  second = rng.integers(0, 256, (14, 14, 3), dtype=np.uint8)
  row = {
      "vit_patches": np.concatenate([patchify(first, 14), patchify(second, 14),
                                     np.zeros((2, 588), np.uint8)]),
      "vit_position_ids": np.concatenate([flattened_position_ids(28, 42, 14, 70,
                                                                 interpolate=False),
                                          flattened_position_ids(14, 14, 14, 70,
                                                                 interpolate=False), [0, 0]]),
      "vit_image_ids": np.array([1] * 6 + [2] + [0, 0]),
  }
  got = vit_images(row, 14)
  assert len(got) == 2
  assert np.array_equal(got[0], first) and np.array_equal(got[1], second)


def test_vae_images_are_cropped_to_their_size():
  images = np.zeros((3, 32, 32, 3), np.uint8)
  images[0, :16, :32] = 7
  got = vae_images({"vae_images": images, "vae_image_hw": np.array([[16, 32], [32, 16], [0, 0]])})
  assert [im.shape for im in got] == [(16, 32, 3), (32, 16, 3)]
  assert (got[0] == 7).all()


def test_inspect_row_draws_a_demo_row_and_summarises_it(demo_config, demo_tokenizer, tmp_path):
  cfg = dataclasses.replace(demo_config, expected_num_tokens=1536, max_num_tokens=2048,
                            max_num_tokens_per_sample=1536, prefer_buffer_before=768)
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0))
  try:
    batch = next(it)
  finally:
    it.close()
  row = {name: value[0] for name, value in batch.items()}
  out = tmp_path / "row.png"
  summary = inspect_row(row, str(out), vit_patch_size=cfg.vit_patch_size, width=512)

  image = Image.open(out)
  assert image.mode == "RGB" and image.width == 70 + 512 and image.height > 512
  n = int(row["num_samples"])
  assert summary.startswith(f"row: L=2048, {n} samples, {int(row['num_tokens'])} tokens")
  assert sum(line.startswith("  sample ") for line in summary.splitlines()) == n
  for word in ("text", "ViT", "VAE", "causal", "fill", "CE", "MSE"):
    assert word in summary


def test_the_legend_never_reuses_a_colour():
  entries = [(band, name, tuple(int(v) for v in colour))
             for band, names in LEGEND for name, colour in names]
  assert {band for band, _, _ in entries} == {"modality", "mode", "loss"}
  assert {name for band, name, _ in entries if band == "mode"} == {"causal", "full", "noise"}
  colours = [colour for _, _, colour in entries]
  assert len(set(colours)) == len(colours), entries


def _literal_row(splits, length=128):
  """A packed row from (sample, mode code, length) splits, padded; no images, no loss."""
  seg, split = np.zeros(length, np.int32), np.zeros(length, np.int32)
  modes, at = np.zeros(length // 2, np.int8), 0
  for s, (sample, mode, n) in enumerate(splits):
    seg[at:at + n], split[at:at + n], modes[s] = sample, s + 1, mode
    at += n
  return {"segment_ids": seg, "split_ids": split, "split_modes": modes,
          "split_lens": np.bincount(split, minlength=len(modes) + 1)[1:].astype(np.int32),
          "token_type": np.where(seg > 0, 1, 0).astype(np.int8),
          "num_tokens": at, "num_samples": int(seg.max()),
          "ce_weights": np.zeros(length, np.float32), "mse_mask": np.zeros(length, bool),
          "vit_patches": np.zeros((length, 588), np.uint8),
          "vit_position_ids": np.zeros(length, np.int32),
          "vit_image_ids": np.zeros(length, np.int32),
          "vae_images": np.zeros((1, 32, 32, 3), np.uint8),
          "vae_image_hw": np.zeros((1, 2), np.int32),
          "num_vit_tokens": 0, "num_vae_tokens": 0}


def test_a_causal_split_is_drawn_as_a_triangle(tmp_path):
  # Sample 1: 30 positions of a full split, then 40 causal ones; sample 2 causal.
  row = _literal_row([(1, 1, 30), (1, 0, 40), (2, 0, 20)])
  out = tmp_path / "row.png"
  inspect_row(row, str(out), vit_patch_size=14, width=128)
  causal = tuple(int(v) for v in dict(LEGEND)["mode"][0][1])
  per_line = (np.asarray(Image.open(out)) == causal).all(-1).sum(1)
  # The enlarged sample (70 positions on 128 pixels) holds a 73-pixel causal triangle:
  # one image line for each width from a few pixels up to the whole split.
  widths = set(per_line[per_line > 0].tolist())
  assert len(widths) >= 40 and max(widths) >= 70


@pytest.mark.parametrize("length, cols, ticks", [
  (1536, 768, [(0, 0), (192, 384), (384, 768), (576, 1152), (768, 1536)]),
  (2048, 768, [(0, 0), (192, 512), (384, 1024), (576, 1536), (768, 2048)]),
  (300, 300, [(0, 0), (75, 75), (150, 150), (225, 225), (300, 300)]),
])
def test_mask_axis_ticks_are_labelled_with_round_positions(length, cols, ticks):
  at = (np.arange(cols) * length) // cols  # the position each column shows, as inspect_row
  assert axis_ticks(at, length) == ticks
  assert all(at[pixel] == position for pixel, position in ticks[:-1])  # shown where labelled


def test_an_enlarged_span_ticks_the_first_pixel_of_each_position():
  at = 100 + (np.arange(40) * 8) // 40  # positions 100..107, five pixels each
  assert axis_ticks(at, 108) == [(0, 100), (10, 102), (20, 104), (30, 106), (40, 108)]
