"""Sample layout and row assembly against upstream's pack_sequence/to_tensor goldens."""

from __future__ import annotations

import numpy as np
import pytest

from bagel_grain.packing.bagel_dict import to_bagel_dict
from bagel_grain.packed_row import SplitMode, TokenType
from bagel_grain.packing.layout import (
    Geometry, SpecialTokens, draw_sample_choices, layout_sample, next_rope, text_tokens, vae_tokens,
    vit_tokens)
from bagel_grain.packing.row import Capacities, RowBuilder
from bagel_grain.sample import PlanItem, Sample, SampleKey
from golden import GOLDEN, load_json

PACK = load_json("pack_layouts.json")
NPZ = np.load(GOLDEN / "pack_layouts.npz")
SPECIAL = SpecialTokens(
    bos=PACK["special_tokens"]["bos_token_id"], eos=PACK["special_tokens"]["eos_token_id"],
    start_of_image=PACK["special_tokens"]["start_of_image"],
    end_of_image=PACK["special_tokens"]["end_of_image"])
INPUTS = {c["name"]: c for c in PACK["cases"] if "__" not in c["name"]}
OUTPUTS = [c for c in PACK["cases"] if "__" in c["name"]]
L = PACK["flex_pad_to"]
CAPS = Capacities(tokens=L, vit_patches=L, vae_tokens=L, vae_images=16,
                  vae_image_size=256, splits=L // 2, vit_patch_size=PACK["vit_patch_size"])


def geometry(interpolate: bool) -> Geometry:
  return Geometry(vit_patch_size=PACK["vit_patch_size"],
                  vae_downsample=PACK["vae_image_downsample"],
                  max_num_patch_per_side=PACK["max_num_patch_per_side"],
                  max_latent_size=PACK["max_latent_size"], interpolate_pos=interpolate)


def plan_item(d: dict) -> PlanItem:
  return PlanItem(type=d["type"], enable_cfg=d["enable_cfg"], loss=d["loss"],
                  special_token_loss=d["special_token_loss"],
                  special_token_label=d["special_token_label"],
                  split_start=d.get("split_start", True), split_end=d.get("split_end", True),
                  frame_delta=d.get("frame_delta"))


def num_draws(plan, drops) -> int:
  """Timesteps a sample draws: loss VAE items that start a split and are kept."""
  it = iter(drops)
  count = 0
  for item in plan:
    dropped = next(it) if item.enable_cfg == 1 else False
    count += item.type == "vae_image" and item.loss == 1 and item.split_start and not dropped
  return count


def golden_row(name: str, interpolate: bool):
  """Lays out the input case's samples and packs them into one row of L tokens."""
  case = INPUTS[name]
  steps = list(case["timesteps_in_draw_order"])
  builder = RowBuilder(CAPS)
  for i, s in enumerate(case["inputs"]):
    plan = tuple(plan_item(d) for d in s["plan"])
    images = tuple(NPZ[key] for key in s["images"])
    texts = tuple(np.asarray(t, np.int32) for t in s["text_ids"])
    sample = Sample(plan=plan, text_ids=texts, images=images,
                    num_tokens=sum(len(t) for t in texts), key=SampleKey(0, i, 0, name))
    drops = tuple(s["cfg_drops_in_plan_order"])
    k = num_draws(plan, drops)
    mine, steps = steps[:k], steps[k:]
    layout = layout_sample(sample.plan, sample.text_ids, sample.images, cfg_drops=drops,
                           timesteps=mine, geometry=geometry(interpolate), special=SPECIAL)
    assert builder.fits(layout)
    builder.add(layout)
  assert not steps
  return builder.build()


def assert_field_equal(name: str, got, want) -> None:
  if isinstance(want, np.ndarray):
    got = np.asarray(got)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if want.dtype.kind == "f":
      assert np.array_equal(np.isneginf(got), np.isneginf(want)), name
      assert np.array_equal(np.isposinf(got), np.isposinf(want)), name
      fin = np.isfinite(want)
      np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-6, err_msg=name)
    else:
      assert np.array_equal(got, want), (name, got, want)
  else:
    got = [list(x) if isinstance(x, tuple) else x for x in got] if isinstance(got, list) else got
    assert got == want, (name, got, want)


@pytest.mark.parametrize("case", OUTPUTS, ids=[c["name"] for c in OUTPUTS])
def test_golden_case(case):
  name, interp, flex = case["name"].split("__")
  assert (interp == "interp") == case["interpolate_pos"]
  row = golden_row(name, case["interpolate_pos"])
  got = to_bagel_dict(row, use_flex=case["use_flex"], pad_to=L)
  want = case["outputs"]
  assert set(got) == set(want)
  for field, value in want.items():
    if field == "nested_attention_masks":
      masks = got[field]
      assert value == f"npz x{len(masks)} (bool: may attend)"
      for i, m in enumerate(masks):
        assert_field_equal(f"{field}_{i}", m, NPZ[f"{case['name']}/{field}_{i}"])
    elif value == "npz":
      assert_field_equal(field, got[field], NPZ[f"{case['name']}/{field}"])
    else:
      assert_field_equal(field, got[field], value)


def test_golden_cases_all_present():
  assert len(INPUTS) == 16 and len(OUTPUTS) == 64


def test_latent_shapes_derived_without_stride():
  row = golden_row("three_samples_one_row", False)
  a = to_bagel_dict(row, use_flex=True)
  b = to_bagel_dict(row, use_flex=True, vae_downsample=PACK["vae_image_downsample"])
  assert a["patchified_vae_latent_shapes"] == b["patchified_vae_latent_shapes"]
  assert a["split_lens"][-1] == L - a["sequence_length"]


# Literal-input unit tests of layout_sample.

GEO = Geometry(vit_patch_size=2, vae_downsample=4, max_num_patch_per_side=10,
               max_latent_size=8, interpolate_pos=False)
TOK = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)


def lay(plan, texts=(), images=(), drops=(), steps=()):
  return layout_sample(plan, [np.asarray(t, np.int32) for t in texts], list(images),
                       cfg_drops=drops, timesteps=steps, geometry=GEO, special=TOK)


def test_text_only_sample():
  out = lay([PlanItem("text"), PlanItem("text", loss=1)], texts=[[50, 51], [60, 61, 62]])
  assert out.text_ids.tolist() == [1, 50, 51, 2, 1, 60, 61, 62, 2]
  assert out.token_type.tolist() == [TokenType.TEXT] * 9
  assert out.position_ids.tolist() == list(range(9))
  assert out.split_ids.tolist() == [1] * 4 + [2] * 5
  assert out.split_lens.tolist() == [4, 5]
  assert out.split_modes.tolist() == [SplitMode.CAUSAL] * 2
  assert out.label_ids.tolist() == [0] * 4 + [60, 61, 62, 2, 0]
  np.testing.assert_array_equal(out.ce_weights, np.float32([0] * 4 + [0.5] * 4 + [0]))
  assert not out.mse_mask.any() and out.num_vit_tokens == 0 and out.num_vae_images == 0
  assert out.max_vae_hw == (0, 0)


def test_vit_sample_patches_and_rope():
  img = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
  out = lay([PlanItem("vit_image", special_token_loss=1, special_token_label=77),
             PlanItem("text", loss=1)], texts=[[9]], images=[img])
  text, vit = TokenType.TEXT, TokenType.VIT
  assert out.token_type.tolist() == [text] + [vit] * 6 + [text] * 4
  assert out.text_ids.tolist() == [3] + [0] * 6 + [4, 1, 9, 2]
  assert out.position_ids.tolist() == [0] * 8 + [1, 2, 3]
  assert out.split_lens.tolist() == [8, 3]
  assert out.split_modes.tolist() == [SplitMode.FULL, SplitMode.CAUSAL]
  assert out.vit_token_index.tolist() == list(range(1, 7))
  assert out.vit_image_ids.tolist() == [1] * 6
  assert out.vit_position_ids.tolist() == [0, 1, 2, 10, 11, 12]
  # Patch (1, 2) holds rows 2..3, columns 4..5; features ordered (py, px, c).
  assert out.vit_patches[5].tolist() == img[2:4, 4:6].reshape(-1).tolist()
  assert out.label_ids[7] == 77 and out.ce_weights[7] == 1.0
  assert out.label_ids[8:10].tolist() == [9, 2]


def test_dropped_items_consume_payloads_and_advance_rope():
  vae0 = np.full((8, 8, 3), 1, np.uint8)
  vit = np.full((2, 4, 3), 2, np.uint8)
  vae1 = np.full((8, 12, 3), 3, np.uint8)
  plan = [PlanItem("vae_image", enable_cfg=1), PlanItem("vit_image", enable_cfg=1),
          PlanItem("text", enable_cfg=1), PlanItem("vae_image", loss=1)]
  out = lay(plan, texts=[[5, 6, 7]], images=[vae0, vit, vae1],
            drops=[True, False, True], steps=[0.25])
  # Dropped VAE: RoPE 0 -> 1; ViT at 1 -> 2; dropped text: nothing; loss VAE at 2.
  assert out.position_ids.tolist() == [1] * 4 + [2] * 8
  assert out.split_modes.tolist() == [SplitMode.FULL, SplitMode.NOISE]
  assert out.split_lens.tolist() == [4, 8]
  assert (out.vit_patches == 2).all() and out.num_vit_tokens == 2
  assert len(out.vae_images) == 1 and out.vae_images[0] is vae1
  assert out.vae_token_index.tolist() == list(range(5, 11))
  assert out.vae_latent_position_ids.tolist() == [0, 1, 2, 8, 9, 10]
  assert out.timesteps[5:11].tolist() == [0.25] * 6 and out.timesteps[[4, 11]].tolist() == [0, 0]
  assert out.mse_mask.tolist() == [False] * 5 + [True] * 6 + [False]
  assert out.max_vae_hw == (8, 12)


def test_clean_vae_is_full_and_advances_rope():
  img = np.zeros((4, 8, 3), np.uint8)
  out = lay([PlanItem("vae_image"), PlanItem("text")], texts=[[]], images=[img])
  assert out.position_ids.tolist() == [0] * 4 + [1, 2]
  assert np.isneginf(out.timesteps[1:3]).all() and not out.mse_mask.any()
  assert out.split_modes.tolist() == [SplitMode.FULL, SplitMode.CAUSAL]
  text, vae = TokenType.TEXT, TokenType.VAE
  assert out.token_type.tolist() == [text, vae, vae, text, text, text]


def test_everything_dropped_is_empty():
  img = np.zeros((4, 4, 3), np.uint8)
  out = lay([PlanItem("text", enable_cfg=1), PlanItem("vit_image", enable_cfg=1)],
            texts=[[5]], images=[img], drops=[True, True])
  assert out.num_tokens == 0 and out.num_splits == 0 and out.vit_patches.shape == (0, 12)


def test_timestep_count_is_checked():
  img = np.zeros((4, 4, 3), np.uint8)
  with pytest.raises(ValueError):
    lay([PlanItem("vae_image", loss=1)], images=[img])
  with pytest.raises(ValueError):
    lay([PlanItem("vae_image")], images=[img], steps=[0.1])


def test_draw_sample_choices_order():
  plan = [PlanItem("text", enable_cfg=1), PlanItem("vae_image", enable_cfg=1),
          PlanItem("vit_image", enable_cfg=1), PlanItem("vae_image", loss=1),
          PlanItem("vae_image", loss=1, split_end=False),
          PlanItem("vae_image", loss=1, split_start=False)]
  drops, steps = draw_sample_choices(plan, np.random.default_rng(3), text_p=0.5, vit_p=0.5,
                                     vae_p=0.5)
  ref = np.random.default_rng(3)
  u = ref.random(3)
  assert drops == tuple(bool(x < 0.5) for x in u)
  assert steps == tuple(ref.standard_normal(2).tolist())
  drops, steps = draw_sample_choices(plan, np.random.default_rng(3), text_p=1.0, vit_p=0.0,
                                     vae_p=1.0)
  assert drops == (True, True, False) and len(steps) == 2


# One plan item at a time: each item type's function on literal inputs.

def test_text_item_with_loss_predicts_the_next_token():
  out = text_tokens(np.asarray([50, 51, 52], np.int32), PlanItem("text", loss=1), 7, TOK)
  assert out.text_ids.tolist() == [1, 50, 51, 52, 2]
  assert out.position_ids.tolist() == [7, 8, 9, 10, 11]
  assert out.label_ids.tolist() == [50, 51, 52, 2, 0]
  np.testing.assert_array_equal(out.ce_weights, np.float32([0.5] * 4 + [0]))
  assert out.mode == SplitMode.CAUSAL and out.patches is None and out.image is None


def test_text_item_special_label_on_its_eos_only():
  item = PlanItem("text", special_token_loss=1, special_token_label=77)
  out = text_tokens(np.asarray([5], np.int32), item, 0, TOK)
  assert out.label_ids.tolist() == [0, 0, 77] and out.ce_weights.tolist() == [0, 0, 1]


def test_vit_item_is_a_marked_run_of_patches_at_one_position():
  image = np.arange(2 * 4 * 3, dtype=np.uint8).reshape(2, 4, 3)  # two 2x2 patches
  out = vit_tokens(image, PlanItem("vit_image"), 3, GEO, TOK)
  assert out.text_ids.tolist() == [3, 0, 0, 4]
  assert out.token_type.tolist() == [TokenType.TEXT, TokenType.VIT, TokenType.VIT,
                                     TokenType.TEXT]
  assert out.position_ids.tolist() == [3] * 4 and out.mode == SplitMode.FULL
  assert out.patches.tolist() == [image[:, :2].reshape(-1).tolist(),
                                  image[:, 2:].reshape(-1).tolist()]
  assert out.patch_position_ids.tolist() == [0, 1] and not out.ce_weights.any()


def test_vae_item_with_a_loss_is_noised_at_its_timestep():
  image = np.zeros((4, 8, 3), np.uint8)  # 1 x 2 latents at stride 4
  out = vae_tokens(image, PlanItem("vae_image", loss=1), 2, 0.5, GEO, TOK)
  assert out.token_type.tolist() == [TokenType.TEXT, TokenType.VAE, TokenType.VAE,
                                     TokenType.TEXT]
  assert out.timesteps.tolist() == [0, 0.5, 0.5, 0] and out.mse_mask.tolist() == [
      False, True, True, False]
  assert out.mode == SplitMode.NOISE and out.image is image
  assert out.latent_position_ids.tolist() == [0, 1]


def test_vae_item_clean_or_a_video_frame_is_a_full_split_without_noise():
  image = np.zeros((4, 4, 3), np.uint8)
  clean = vae_tokens(image, PlanItem("vae_image"), 0, -np.inf, GEO, TOK)
  assert clean.mode == SplitMode.FULL and not clean.mse_mask.any()
  frame = vae_tokens(image, PlanItem("vae_image", loss=1, frame_delta=2), 0, 0.1, GEO, TOK)
  assert frame.mode == SplitMode.FULL and frame.mse_mask.tolist() == [False, True, False]
  # A loss item whose split drew no timestep (its start was dropped) stays clean.
  unnoised = vae_tokens(image, PlanItem("vae_image", loss=1), 0, -np.inf, GEO, TOK)
  assert not unnoised.mse_mask.any()


def test_rope_after_each_kind_of_item():
  text = text_tokens(np.asarray([5, 6], np.int32), PlanItem("text"), 0, TOK)
  image = np.zeros((4, 4, 3), np.uint8)
  vit = vit_tokens(image, PlanItem("vit_image"), 0, GEO, TOK)
  vae = vae_tokens(image, PlanItem("vae_image"), 0, -np.inf, GEO, TOK)
  assert next_rope(PlanItem("text"), 10, text) == 14
  assert next_rope(PlanItem("text"), 10, None) == 10  # dropped
  assert next_rope(PlanItem("vit_image"), 10, vit) == 11
  assert next_rope(PlanItem("vit_image"), 10, None) == 11
  assert next_rope(PlanItem("vae_image"), 10, vae) == 11
  assert next_rope(PlanItem("vae_image", loss=1), 10, None) == 11
  assert next_rope(PlanItem("vae_image", loss=1), 10, vae) == 10  # noised: the next shares
  assert next_rope(PlanItem("vae_image", loss=1, frame_delta=3), 10, vae) == 13
