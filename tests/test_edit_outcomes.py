"""The edit-chain parser produces exactly upstream's outcomes (golden edit_outcomes.json)."""

import io

import numpy as np
import pytest
from PIL import Image

from bagel_grain.families.edit import EditTransform
from bagel_grain.images import ImageTransform
from bagel_grain.sample import SpecialTokens
from bagel_grain.sample import Sample
from bagel_grain.sources.records import Record
from golden import load_json

_DOC = load_json("edit_outcomes.json")
SEEDS = 400


class CharTokenizer:
  """One token per character (the golden's `num_tokens` counts characters)."""

  special = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)

  def encode(self, text):
    return np.array([ord(c) for c in text], np.int32)

  def encode_batch(self, texts):
    return [self.encode(t) for t in texts]

  def fingerprint(self):
    return "chars"


def solid_png(i):
  """Row image i: 64x64, colour (10 * (i + 1), 0, 0)."""
  buf = io.BytesIO()
  Image.new("RGB", (64, 64), (10 * (i + 1), 0, 0)).save(buf, "PNG")
  return buf.getvalue()


def source_index(pixels):
  """Which row image an item shows, read from its (uniform) colour."""
  red = int(pixels[0, 0, 0])
  assert (pixels == np.array([red, 0, 0], np.uint8)).all()
  assert red % 10 == 0
  return red // 10 - 1


def outcome(sample):
  plan = tuple((p.type, p.enable_cfg, p.loss) for p in sample.plan)
  texts = tuple("".join(map(chr, ids)) for ids in sample.text_ids)
  sources = tuple(source_index(image) for image in sample.images)
  return plan, texts, sources, sample.num_tokens


def golden_outcome(o):
  plan = tuple((p["type"], p["enable_cfg"], p["loss"]) for p in o["plan"])
  return plan, tuple(o["texts"]), tuple(o["image_source_index"]), o["num_tokens"]


@pytest.mark.parametrize("case", _DOC["cases"], ids=lambda c: f"{c['num_images']}_images")
def test_edit_outcomes_match_upstream(case):
  edit = EditTransform(vae_transform=ImageTransform(**case["transform"]),
                       vit_transform=ImageTransform(**case["vit_transform"]),
                       group=1, tokenizer=CharTokenizer(), max_decode_pixels=1 << 20)
  fields = {"image_list": [solid_png(i) for i in range(case["num_images"])],
            "instruction_list": case["instruction_list"]}
  record = Record(index=0, epoch=0, record_id="edit.parquet#0", dataset=0, fields=fields)
  produced = set()
  for seed in range(SEEDS):
    sample = edit.random_map(record, np.random.default_rng(seed))
    assert isinstance(sample, Sample), sample
    produced.add(outcome(sample))
  expected = {golden_outcome(o) for o in case["outcomes"]}
  assert produced - expected == set()  # nothing upstream cannot produce
  assert expected - produced == set()  # and every upstream outcome shows up
