"""Text-to-image rows (parquet `image`, `captions`) -> [caption text, loss VAE image]."""

from __future__ import annotations

import json

import numpy as np

from bagel_grain.drops import IMAGE_REASONS, RECORD_REASONS, Drop, DropReason, Note, require
from bagel_grain.families.base import FamilyTransform, is_text
from bagel_grain.families.family import Family
from bagel_grain.images import ImageTransform
from bagel_grain.sample import PlanItem, Sample
from bagel_grain.sources.records import Record

PLAN = (PlanItem("text", enable_cfg=1, loss=0), PlanItem("vae_image", enable_cfg=0, loss=1))
COLUMNS = ("image", "captions")


def parse_captions(raw) -> list[str]:
  """The caption dict's values in file order; raises Drop unless a mapping of strings."""
  require(isinstance(raw, (str, bytes)), DropReason.BAD_CAPTION,
          f"captions is {type(raw).__name__}")
  try:
    captions = json.loads(raw)
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise Drop(DropReason.BAD_CAPTION, f"invalid JSON: {e}") from None
  require(isinstance(captions, dict), DropReason.BAD_CAPTION, "captions JSON is not a mapping")
  values = list(captions.values())
  require(all(is_text(v) for v in values), DropReason.BAD_CAPTION, "a caption is not UTF-8 text")
  return values


class T2ITransform(FamilyTransform):
  """One caption chosen uniformly; an empty caption dict keeps the row with caption " "."""

  def __init__(self, *, vae_transform: ImageTransform, **kwargs):
    super().__init__(**kwargs)
    self.vae_transform = vae_transform

  def parse(self, record: Record, rng: np.random.Generator) -> Sample:
    fields = record.fields
    require(isinstance(fields, dict), DropReason.WRONG_TYPE, "row is not a mapping")
    captions = parse_captions(fields.get("captions"))
    notes = ()
    if captions:
      caption = captions[int(rng.integers(len(captions)))]
    else:
      caption, notes = " ", (Note.EMPTY_CAPTION,)  # upstream: an unconditional sample
    self.check_text_length([caption])
    [pixels] = self.load(fields.get("image"), [(self.vae_transform, 1)])
    ids = self.encode(caption)
    num_tokens = len(ids) + self.image_tokens(pixels, self.vae_transform.image_stride)
    return Sample(PLAN, (ids,), (pixels,), num_tokens, self.key(record), notes)


FAMILY = Family(
    name="t2i_pretrain",
    transform=T2ITransform,
    image_roles={"vae": "image_transform"},
    columns=COLUMNS,
    drop_reasons=RECORD_REASONS | IMAGE_REASONS | {DropReason.WRONG_TYPE,
                                                   DropReason.BAD_CAPTION,
                                                   DropReason.TEXT_TOO_LONG,
                                                   DropReason.FILE_TOO_LARGE})
