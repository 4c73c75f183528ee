"""Property tests of RowBuilder: random samples packed into rows of random capacities."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagel_grain.packing.attention import row_mask
from bagel_grain.packing.bagel_dict import to_bagel_dict
from bagel_grain.packed_row import ROW_FIELDS, TokenType
from bagel_grain.packing.layout import Geometry, SpecialTokens, layout_sample
from bagel_grain.packing.row import (EMPTY, Capacities, RowBuilder, Usage, default_capacities,
                                    empty_row, write_row)
from bagel_grain.sample import PlanItem

P, D = 2, 4
TOK = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)
SPECIAL_LABEL = 9000  # special-token labels are 9000 + item number; text ids stay below


def _image(seed: int, h: int, w: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(1, 256, (h, w, 3), dtype=np.uint8)


@st.composite
def samples(draw):
  """(plan, texts, images, drops, timesteps) of one random sample."""
  plan, texts, images = [], [], []
  for i in range(draw(st.integers(1, 6))):
    kind = draw(st.sampled_from(["text", "vit_image", "vae_image", "video"]))
    stl = draw(st.integers(0, 1))
    common = dict(enable_cfg=draw(st.integers(0, 1)), loss=draw(st.integers(0, 1)),
                  special_token_loss=stl, special_token_label=SPECIAL_LABEL + i if stl else None)
    if kind == "text":
      plan.append(PlanItem("text", **common))
      texts.append(np.asarray(draw(st.lists(st.integers(10, 999), max_size=8)), np.int32))
    elif kind == "vit_image":
      plan.append(PlanItem("vit_image", **common))
      images.append(_image(draw(st.integers(0, 99)), P * draw(st.integers(1, 4)),
                           P * draw(st.integers(1, 4))))
    elif kind == "vae_image":
      plan.append(PlanItem("vae_image", **common))
      images.append(_image(draw(st.integers(0, 99)), D * draw(st.integers(1, 4)),
                           D * draw(st.integers(1, 4))))
    else:
      frames = draw(st.integers(2, 3))
      loss = draw(st.integers(0, 1))
      for f in range(frames):
        last = f == frames - 1
        plan.append(PlanItem("vae_image", loss=loss, split_start=f == 0, split_end=last,
                             frame_delta=None if last else draw(st.integers(1, 3))))
        images.append(_image(draw(st.integers(0, 99)), D * 2, D * 3))
  drops = [draw(st.booleans()) for it in plan if it.enable_cfg == 1]
  it_drops = iter(drops)
  n_steps = 0
  for it in plan:
    dropped = next(it_drops) if it.enable_cfg == 1 else False
    n_steps += it.type == "vae_image" and it.loss == 1 and it.split_start and not dropped
  steps = [draw(st.floats(-3, 3)) for _ in range(n_steps)]
  return plan, texts, images, drops, steps


# Tight capacities exercise every overflow; roomy ones fill rows with many samples.
capacities = st.one_of(
    st.builds(Capacities, tokens=st.sampled_from([128, 256]), vit_patches=st.integers(0, 200),
              vae_tokens=st.integers(0, 200), vae_images=st.integers(0, 4),
              vae_image_size=st.sampled_from([8, 12, 16]), splits=st.integers(1, 40),
              vit_patch_size=st.just(P)),
    st.builds(Capacities, tokens=st.sampled_from([256, 384]), vit_patches=st.just(256),
              vae_tokens=st.just(256), vae_images=st.integers(6, 12), vae_image_size=st.just(16),
              splits=st.just(128), vit_patch_size=st.just(P)))


@settings(max_examples=200, deadline=None)
@given(st.lists(samples(), min_size=1, max_size=8), capacities, st.booleans())
def test_row_builder_invariants(raw, caps, interpolate):
  geo = Geometry(vit_patch_size=P, vae_downsample=D, max_num_patch_per_side=8,
                 max_latent_size=8, interpolate_pos=interpolate)
  builder = RowBuilder(caps)
  added = []
  for plan, texts, images, drops, steps in raw:
    layout = layout_sample(plan, texts, images, cfg_drops=drops, timesteps=steps,
                           geometry=geo, special=TOK)
    if builder.fits(layout):
      builder.add(layout)
      added.append(layout)
    else:
      with pytest.raises(ValueError):
        builder.add(layout)
  row = builder.build()
  L, V, T, I, S, K = (caps.tokens, caps.vit_patches, caps.vae_tokens, caps.vae_images,
                      caps.vae_image_size, caps.splits)

  # Static shapes and dtypes: exactly an empty row's.
  ref = empty_row(caps)
  assert tuple(row) == ROW_FIELDS and set(ref) == set(ROW_FIELDS)
  for name in ROW_FIELDS:
    assert row[name].shape == ref[name].shape and row[name].dtype == ref[name].dtype, name

  # Counts match the layouts and never exceed the capacities.
  n, v, t = int(row["num_tokens"]), int(row["num_vit_tokens"]), int(row["num_vae_tokens"])
  assert n == sum(x.num_tokens for x in added) == builder.used_tokens <= L
  assert v == sum(x.num_vit_tokens for x in added) <= V
  assert t == sum(x.num_vae_tokens for x in added) <= T
  assert int(row["num_samples"]) == len(added) == builder.num_samples
  num_images = sum(x.num_vae_images for x in added)
  assert num_images <= I
  k = sum(x.num_splits for x in added)
  assert k <= K
  assert not caps.overflows(builder.usage)

  # Every position is exactly one of text/ViT/VAE/pad.
  tt = row["token_type"]
  assert set(np.unique(tt[:n]).tolist()) <= {TokenType.TEXT, TokenType.VIT, TokenType.VAE}
  assert (tt[n:] == TokenType.PAD).all()
  vit_idx, vae_idx = row["vit_token_index"], row["vae_token_index"]
  assert (vit_idx[v:] == L).all() and (vae_idx[t:] == L).all()
  assert np.array_equal(np.sort(vit_idx[:v]), np.flatnonzero(tt == TokenType.VIT))
  assert np.array_equal(np.sort(vae_idx[:t]), np.flatnonzero(tt == TokenType.VAE))
  assert (row["text_ids"][tt != TokenType.TEXT] == 0).all()
  assert (row["text_ids"][tt == TokenType.TEXT] > 0).all()

  # Samples and splits tile the real tokens.
  seg, split = row["segment_ids"], row["split_ids"]
  assert (seg[n:] == 0).all() and (split[n:] == 0).all()
  assert np.array_equal(np.bincount(seg[:n], minlength=len(added) + 1)[1:],
                        [x.num_tokens for x in added])
  assert np.array_equal(np.bincount(split[:n], minlength=k + 1)[1:], row["split_lens"][:k])
  assert (row["split_lens"][k:] == 0).all() and (np.diff(split[:n]) >= 0).all()
  assert (row["split_lens"][:k] >= 2).all()

  # ViT images numbered 1.. over the row, in order.
  ids = row["vit_image_ids"][:v]
  assert (row["vit_image_ids"][v:] == 0).all()
  if v:
    assert ids[0] == 1 and set(np.diff(ids).tolist()) <= {0, 1}

  # CE: next text token, or the item's special label on a closing token.
  text = row["text_ids"]
  for q in np.flatnonzero(row["ce_weights"] > 0):
    assert tt[q] == TokenType.TEXT
    if text[q] in (TOK.eos, TOK.end_of_image):
      assert row["label_ids"][q] >= SPECIAL_LABEL and row["ce_weights"][q] == 1.0
    else:
      assert q + 1 < n and tt[q + 1] == TokenType.TEXT and row["label_ids"][q] == text[q + 1]
  assert (row["label_ids"][row["ce_weights"] == 0] == 0).all()

  # mse only on VAE latents with finite timesteps; other positions have timestep 0.
  mse, ts = row["mse_mask"], row["timesteps"]
  assert (tt[mse] == TokenType.VAE).all() and np.isfinite(ts[mse]).all()
  assert (ts[tt != TokenType.VAE] == 0).all()

  # VAE images top-left aligned, zero elsewhere, within S.
  hw = row["vae_image_hw"]
  images = [im for x in added for im in x.vae_images]
  assert (hw[len(images):] == 0).all() and not row["vae_images"][len(images):].any()
  for i, im in enumerate(images):
    h, w = im.shape[:2]
    assert hw[i].tolist() == [h, w] and h <= S and w <= S
    assert np.array_equal(row["vae_images"][i, :h, :w], im)
    assert not row["vae_images"][i, h:].any() and not row["vae_images"][i, :, w:].any()

  # The upstream view and the row mask agree with the per-sample dense masks.
  if n:
    dense = to_bagel_dict(row, use_flex=False)
    flex = to_bagel_dict(row, use_flex=True)
    assert flex["split_lens"][-1] == L - n and sum(flex["sample_lens"]) == L
    mask = row_mask(seg, split, row["split_modes"])
    off = 0
    for m in dense["nested_attention_masks"]:
      assert np.array_equal(mask[off:off + len(m), off:off + len(m)], m)
      off += len(m)
    assert int(mask.sum()) == sum(int(m.sum()) for m in dense["nested_attention_masks"])
    if images:
      assert (to_bagel_dict(row, use_flex=True, vae_downsample=D)["patchified_vae_latent_shapes"]
              == flex["patchified_vae_latent_shapes"])

  builder.reset()
  assert builder.used_tokens == 0 and builder.num_samples == 0
  assert int(builder.build()["num_tokens"]) == 0


ROOMY = Capacities(tokens=384, vit_patches=256, vae_tokens=256, vae_images=12,
                   vae_image_size=16, splits=128, vit_patch_size=P)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(samples(), max_size=6), min_size=2, max_size=5), st.booleans())
def test_a_row_written_over_earlier_rows_is_the_row_written_fresh(rows, interpolate):
  """One buffer takes row after row (told what the last one wrote); each must equal the
  same samples written into a fresh empty row, down to the bits of every field."""
  geo = Geometry(vit_patch_size=P, vae_downsample=D, max_num_patch_per_side=8,
                 max_latent_size=8, interpolate_pos=interpolate)
  buffer, previous = empty_row(ROOMY), EMPTY
  for raw in rows:
    builder, added = RowBuilder(ROOMY), []
    for plan, texts, images, drops, steps in raw:
      layout = layout_sample(plan, texts, images, cfg_drops=drops, timesteps=steps,
                             geometry=geo, special=TOK)
      if builder.fits(layout):
        builder.add(layout)
        added.append(layout)
    fresh = builder.build()
    previous = write_row(buffer, added, previous=previous)
    for name in ROW_FIELDS:
      assert buffer[name].tobytes() == fresh[name].tobytes(), name


def test_default_capacities():
  caps = default_capacities(32001, 1000, 16, 1024, 14)
  assert caps.tokens == 32128 == caps.vit_patches == caps.vae_tokens
  assert caps.vae_image_size == 1008 and caps.vae_images == 16 and caps.splits == 16064
  assert default_capacities(32000, 1024, 16, 1024, 14).tokens == 32000
  assert default_capacities(128, 64, 16, 1000, 14).vae_images == 1
  # The docstring's example: about 68 MiB per row.
  mib = default_capacities(32768, 1024, 16, 1024, 14).row_nbytes() / 2**20
  assert 67 < mib < 69


def test_usage_adds_and_takes_the_largest_side():
  a = Usage(tokens=3, vae_images=1, vae_image_size=16)
  b = Usage(tokens=4, splits=2, vae_image_size=8)
  assert a + b == Usage(tokens=7, vae_images=1, splits=2, vae_image_size=16)
  caps = Capacities(tokens=128, vit_patches=0, vae_tokens=0, vae_images=1,
                    vae_image_size=12, splits=2)
  assert caps.overflows(a + b) == ("vae_image_size",)
  with pytest.raises(ValueError):
    Capacities(tokens=100, vit_patches=0, vae_tokens=0, vae_images=0, vae_image_size=0,
               splits=1)


def test_empty_sample_in_a_row():
  geo = Geometry(vit_patch_size=P, vae_downsample=D, max_num_patch_per_side=8,
                 max_latent_size=8, interpolate_pos=False)
  text = [np.asarray([11, 12], np.int32)]
  empty = layout_sample([PlanItem("text", enable_cfg=1)], text, [], cfg_drops=[True],
                        timesteps=[], geometry=geo, special=TOK)
  full = layout_sample([PlanItem("text", loss=1)], text, [], cfg_drops=[], timesteps=[],
                       geometry=geo, special=TOK)
  builder = RowBuilder(Capacities(tokens=128, vit_patches=0, vae_tokens=0, vae_images=0,
                                  vae_image_size=0, splits=4, vit_patch_size=P))
  for layout in (full, empty, full):
    builder.add(layout)
  row = builder.build()
  assert row["segment_ids"][:9].tolist() == [1] * 4 + [3] * 4 + [0]
  assert row["split_ids"][:8].tolist() == [1] * 4 + [2] * 4
  dense = to_bagel_dict(row, use_flex=False)
  assert dense["sample_lens"] == [4, 0, 4]
  assert [m.shape for m in dense["nested_attention_masks"]] == [(4, 4), (0, 0), (4, 4)]
  assert to_bagel_dict(row, use_flex=True)["split_lens"] == [4, 4, 120]
