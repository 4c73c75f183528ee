"""Unified image-editing rows (parquet `image_list`, `instruction_list`) -> an edit chain."""

from __future__ import annotations

import numpy as np

from bagel_grain.drops import IMAGE_REASONS, RECORD_REASONS, DropReason, require
from bagel_grain.families.base import FamilyTransform, is_text
from bagel_grain.families.family import Family
from bagel_grain.images import ImageTransform
from bagel_grain.sample import PlanItem, Sample
from bagel_grain.sources.records import Record

COLUMNS = ("image_list", "instruction_list")
VAE_COND = PlanItem("vae_image", enable_cfg=1, loss=0)
VIT_COND = PlanItem("vit_image", enable_cfg=1, loss=0)
VAE_LOSS = PlanItem("vae_image", enable_cfg=0, loss=1)
INSTRUCTION = PlanItem("text", enable_cfg=1, loss=0)


def check_row(images, instructions) -> None:
  """Raises Drop unless the lists describe a chain of >= 2 images with a step each."""
  bad = DropReason.BAD_EDIT_LISTS
  require(isinstance(images, list), bad, "image_list is not a list")
  require(len(images) >= 2, bad, f"{len(images)} images, need >= 2")
  require(isinstance(instructions, list), bad, "instruction_list is not a list")
  require(len(instructions) == len(images) - 1, bad,
          f"{len(instructions)} instruction steps for {len(images)} images")
  for step in instructions:
    require(isinstance(step, list), bad, "a step is not a list of paraphrases")
    require(len(step) > 0, bad, "a step has no paraphrase")
    require(all(is_text(p) for p in step), bad, "a paraphrase is not UTF-8 text")


class EditTransform(FamilyTransform):
  """BAGEL's edit-chain choice: a start image, 1-2 steps, optionally joined instructions.

  start in range(n-1), end in range(start+1, min(start+3, n)). With two steps a coin
  (p=0.5) joins the instructions into one text and keeps only the final image as a
  loss target; upstream then moves `end` back by one when it is the last image of
  the row, and we keep that quirk. Otherwise each step is its instruction followed
  by the next image: intermediate images as loss-VAE + clean-VAE + ViT, the final
  one as loss-VAE.
  """

  def __init__(self, *, vae_transform: ImageTransform, vit_transform: ImageTransform,
               **kwargs):
    super().__init__(**kwargs)
    self.vae_transform = vae_transform
    self.vit_transform = vit_transform

  def parse(self, record: Record, rng: np.random.Generator) -> Sample:
    fields = record.fields
    require(isinstance(fields, dict), DropReason.WRONG_TYPE, "row is not a mapping")
    images, instructions = fields.get("image_list"), fields.get("instruction_list")
    check_row(images, instructions)
    n = len(images)
    start = int(rng.integers(n - 1))
    end = int(rng.integers(start + 1, min(start + 3, n)))
    pick = lambda step: step[int(rng.integers(len(step)))]

    plan, texts, sources = [VAE_COND, VIT_COND], [], [("vae", start), ("vit", start)]
    if end - start > 1 and rng.random() < 0.5:
      if end == n - 1:
        end -= 1  # upstream quirk, kept on purpose
      joined = "".join(pick(instructions[i - 1]) + ". " for i in range(start + 1, end + 1))
      texts.append(joined.rstrip())
      plan += [INSTRUCTION, VAE_LOSS]
      sources.append(("vae", end))
    else:
      for i in range(start + 1, end + 1):
        texts.append(pick(instructions[i - 1]))
        plan.append(INSTRUCTION)
        if i != end:
          plan += [VAE_LOSS, VAE_COND, VIT_COND]
          sources += [("vae", i), ("vae", i), ("vit", i)]
        else:
          plan.append(VAE_LOSS)
          sources.append(("vae", i))

    self.check_text_length(texts)
    kinds: dict[int, list[str]] = {}  # image -> the transforms it needs; decoded once
    for kind, i in sources:
      if kind not in kinds.setdefault(i, []):
        kinds[i].append(kind)
    resized = {}
    for i, needed in kinds.items():
      transforms = [self.vae_transform if k == "vae" else self.vit_transform for k in needed]
      for k, pixels in zip(needed, self.load(images[i], [(t, 1) for t in transforms])):
        resized[(k, i)] = pixels
    pixels = tuple(resized[s] for s in sources)
    ids = tuple(self.tokenize(texts))
    num_tokens = sum(len(t) for t in ids) + sum(
        self.image_tokens(p, self.vae_transform.image_stride if kind == "vae"
                          else self.vit_transform.image_stride)
        for p, (kind, _) in zip(pixels, sources))
    return Sample(tuple(plan), ids, pixels, num_tokens, self.key(record))


FAMILY = Family(
    name="unified_edit",
    transform=EditTransform,
    image_roles={"vae": "image_transform", "vit": "vit_image_transform"},
    columns=COLUMNS,
    drop_reasons=RECORD_REASONS | IMAGE_REASONS | {DropReason.WRONG_TYPE,
                                                   DropReason.BAD_EDIT_LISTS,
                                                   DropReason.TEXT_TOO_LONG,
                                                   DropReason.FILE_TOO_LARGE})
