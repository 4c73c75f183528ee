"""Edit rows: upstream's chain choice (start image, 1-2 steps), inconsistent lists dropped."""

import numpy as np
import pytest

from bagel_grain.drops import Dropped
from bagel_grain.families.edit import EditTransform
from bagel_grain.images import ImageTransform
from family_records import make_record, shape
from vlm_files import png

VAE_COND, VIT_COND, TEXT_COND, VAE_LOSS = (
  ("vae_image", 1, 0), ("vit_image", 1, 0), ("text", 1, 0), ("vae_image", 0, 1))
EDIT_ONE_STEP = [VAE_COND, VIT_COND, TEXT_COND, VAE_LOSS]
EDIT_TWO_STEPS = [VAE_COND, VIT_COND, TEXT_COND, VAE_LOSS, VAE_COND, VIT_COND, TEXT_COND,
                  VAE_LOSS]


def _edit_texts(steps):
  singles = {p for step in steps for p in step}
  joined = {(a + ". ").rstrip() for a in singles} | {
    (a + ". " + b + ". ").rstrip()
    for first, second in zip(steps, steps[1:]) for a in first for b in second}
  return singles, joined


def test_edit_plans_are_upstream_chains(demo_epoch, demo_tokenizer):
  seen = set()
  for record, sample in demo_epoch("unified_edit"):
    plan = shape(sample)
    steps = record.fields["instruction_list"]
    texts = [demo_tokenizer.decode(t) for t in sample.text_ids]
    singles, joined = _edit_texts(steps)
    assert len(sample.images) == sum(t != "text" for t, _, _ in plan)
    if plan == EDIT_ONE_STEP:
      assert texts[0] in singles | joined
    else:
      assert plan == EDIT_TWO_STEPS
      assert any(texts[0] in a and texts[1] in b for a, b in zip(steps, steps[1:]))
      # The intermediate image is both the first loss target and the next condition.
      np.testing.assert_array_equal(sample.images[2], sample.images[3])
    seen.add(len(plan))
  assert seen == {4, 8}


@pytest.mark.parametrize("images,instructions", [
  (3, [["one step"]]),             # two images need two steps
  (1, []),                         # a chain needs two images
  (2, [[]]),                       # a step without a paraphrase
  (2, ["not a list of paraphrases"]),
  (2, [[3]]),
  (2, "do it"),
])
def test_edit_inconsistent_lists(demo_tokenizer, images, instructions):
  edit = EditTransform(vae_transform=ImageTransform(max_image_size=64, min_image_size=32,
                                                   image_stride=16),
                       vit_transform=ImageTransform(max_image_size=56, min_image_size=28,
                                                    image_stride=14), group=1,
                       tokenizer=demo_tokenizer, max_decode_pixels=10**7)
  fields = {"image_list": [png((10, 0, 0))] * images, "instruction_list": instructions}
  out = edit.random_map(make_record(fields), np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "bad_edit_lists"
