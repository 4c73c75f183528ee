"""Property fuzzing of the row parsers: any value in, a valid Sample or a Dropped marker out.

Each family's `random_map` is fed arbitrary JSON-like field values (what a parquet
row or a converted record can hold) or arbitrary JSONL bytes; the only allowed
outcomes are a `Dropped` with a known reason or a `Sample` meeting the sample
contract (docs/design.md, section 3). Any other exception is a parser bug: in a worker
it would kill the stream instead of being counted.
"""

import io
import json
import os

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from PIL import Image

from bagel_grain.families.edit import EditTransform
from bagel_grain.families.t2i import PLAN as T2I_PLAN
from bagel_grain.families.t2i import T2ITransform
from bagel_grain.families.registry import FAMILIES
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.families.vlm import VLMTransform
from bagel_grain.images import ImageError, ImageTransform, decode_image
from bagel_grain.drops import Dropped
from bagel_grain.sample import Sample
from bagel_grain.sources.records import Record

# BAGEL_FUZZ_EXAMPLES=5000 for a longer local hunt; CI keeps the suite fast.
FUZZ = hypothesis.settings(max_examples=int(os.environ.get("BAGEL_FUZZ_EXAMPLES", 150)),
                           deadline=None, derandomize=True,
                           suppress_health_check=[hypothesis.HealthCheck.too_slow,
                                                  hypothesis.HealthCheck.data_too_large])
MAX_DECODE = 1_000_000
VAE = ImageTransform(max_image_size=64, min_image_size=32, image_stride=16)
VIT = ImageTransform(max_image_size=56, min_image_size=28, image_stride=14)
FRAMES = FrameSamplerArgs(max_num_frames=3, min_num_frames=2)
REASONS = {"bad_image", "too_many_pixels", "truncated_image", "wrong_type", "bad_caption",
           "bad_edit_lists", "bad_json", "blank_line", "bad_turn", "no_loss_item", "missing_file",
           "path_outside_data_dir", "video_unreadable", "not_a_regular_file",
           "no_video_placeholder"}
FAMILY_OF = {family.transform: family for family in FAMILIES.values()}


def encoded(fmt: str, size=(40, 24), mode="RGB") -> bytes:
  buf = io.BytesIO()
  Image.new(mode, size, 90).save(buf, fmt)
  return buf.getvalue()


PNG, JPEG = encoded("PNG"), encoded("JPEG")
SEEDS = [encoded("PNG", mode="P"), encoded("PNG", mode="RGBA"), encoded("GIF", mode="P"),
         encoded("BMP"), encoded("TIFF"), encoded("WEBP"), JPEG, PNG,
         encoded("PNG", (2000, 1000))]  # over MAX_DECODE

# --- strategies -------------------------------------------------------------------------


def mostly(good, bad, odds: int = 4):
  """`good` except once in `odds`: deep enough into the parser to build samples too."""
  return st.integers(0, odds - 1).flatmap(lambda i: bad if i == 0 else good)


clean_text = st.text(max_size=12)
# Lone surrogates too: JSON's "\ud800" escapes produce them, UTF-8 cannot hold them.
text = mostly(clean_text, st.text(st.characters() | st.characters(categories=["Cs"]),
                                  max_size=12), odds=12)
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | text
           | st.binary(max_size=16) | st.sampled_from([PNG, JPEG, b"\x89PNG\r\n\x1a\n"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(text, inner, max_size=4), max_leaves=10)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text,
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(text, inner, max_size=4), max_leaves=10)
images = mostly(st.sampled_from(SEEDS), values)
captions = mostly(st.dictionaries(clean_text, text, max_size=3).map(json.dumps),
                  values | json_values.map(json.dumps))
step = mostly(st.lists(text, min_size=1, max_size=3), values, odds=8)
edit_fields = st.integers(2, 4).flatmap(lambda n: st.fixed_dictionaries({
    "image_list": mostly(st.lists(images, min_size=n, max_size=n), values),
    "instruction_list": mostly(st.lists(step, min_size=n - 1, max_size=n - 1), values),
}))
t2i_fields = st.fixed_dictionaries({"image": images, "captions": captions})
any_fields = values | st.dictionaries(st.sampled_from(["image", "captions", "image_list",
                                                       "instruction_list"]), values)

paths = mostly(st.sampled_from(["a.png", "clip/", "empty/", "nope.png", "nope/", "a.png/",
                                "clip", "../outside.png", "/etc/hostname", "link.png",
                                "corrupt.png", "clip/../../outside.png", "", ".", "./",
                                "gs://bucket/x.png", "clip/../a.png"]), text)
human = mostly(st.sampled_from(["<image>", "<video>", "<image>\n<image>", "Hi <image> there",
                                " ", "Describe."]), text)
turn = mostly(st.fixed_dictionaries({"from": mostly(st.sampled_from(["human", "gpt", "system"]),
                                                    json_values, odds=10),
                                     "value": mostly(human, json_values, odds=10)}),
              json_values, odds=10)
answer = st.fixed_dictionaries({"from": st.just("gpt"), "value": text})
conversations = st.tuples(st.lists(turn, max_size=3), answer).map(lambda t: t[0] + [t[1]])
rows = st.fixed_dictionaries(
    {"conversations": mostly(conversations, st.lists(turn, max_size=3) | json_values)},
    optional={"image": mostly(paths | st.lists(paths, max_size=3), json_values),
              "video": mostly(paths, json_values), "id": json_values})
lines = mostly(rows.map(lambda r: json.dumps(r).encode()),
               st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))


# --- the transforms ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def transforms(tmp_path_factory, demo_tokenizer):
  root = tmp_path_factory.mktemp("fuzz")
  data = root / "data"
  (data / "clip").mkdir(parents=True)
  (data / "empty").mkdir()
  (data / "a.png").write_bytes(encoded("PNG", (30, 20)))
  (data / "corrupt.png").write_bytes(PNG[:30])
  (root / "outside.png").write_bytes(PNG)
  os.symlink(root / "outside.png", data / "link.png")
  for n in range(1, 4):
    (data / "clip" / f"frame_{n}.jpg").write_bytes(encoded("JPEG", (28, 28)))
  common = dict(tokenizer=demo_tokenizer, max_decode_pixels=MAX_DECODE)
  return {
      "t2i": T2ITransform(vae_transform=VAE, group=0, **common),
      "edit": EditTransform(vae_transform=VAE, vit_transform=VIT, group=1, **common),
      "vlm": VLMTransform(vit_transform=VIT, frame_sampler=FRAMES, data_dirs=(str(data),),
                          group=2, **common),
  }


def run(transform, fields, seed: int = 0):
  record = Record(index=seed, epoch=0, record_id="fuzz#0", dataset=0, fields=fields)
  out = transform.random_map(record, np.random.default_rng(seed))
  assert isinstance(out, (Sample, Dropped)), type(out)
  if isinstance(out, Dropped):
    assert out.reason in REASONS, out
    assert out.reason in FAMILY_OF[type(transform)].drop_reasons, out  # as its family declares
    assert out.key.record == "fuzz#0"
  else:
    check_sample(out, transform)
  return out


def outcome(out) -> str:
  return out.reason if isinstance(out, Dropped) else "sample"


def check_sample(sample: Sample, transform) -> None:
  """The sample contract: payloads match the plan, images resized, num_tokens adds up."""
  kinds = [item.type for item in sample.plan]
  assert len(sample.text_ids) == kinds.count("text")
  assert len(sample.images) == len(kinds) - kinds.count("text")
  for ids in sample.text_ids:
    assert ids.dtype == np.int32 and ids.ndim == 1
  image_items = [item for item in sample.plan if item.type != "text"]
  tokens = sum(len(ids) for ids in sample.text_ids)
  for item, pixels in zip(image_items, sample.images):
    t = VIT if item.type == "vit_image" else VAE
    h, w, c = pixels.shape
    assert pixels.dtype == np.uint8 and c == 3
    assert h % t.image_stride == 0 and w % t.image_stride == 0 and 0 < max(h, w) <= t.max_image_size
    tokens += h * w // t.image_stride**2
  assert sample.num_tokens == tokens
  assert any(item.loss for item in sample.plan)
  assert sample.key.group == transform.group and sample.key.record == "fuzz#0"


# --- properties ---------------------------------------------------------------------------


@FUZZ
@hypothesis.given(fields=mostly(t2i_fields, any_fields), seed=st.integers(0, 3))
def test_t2i_rows_become_samples_or_drops(transforms, fields, seed):
  out = run(transforms["t2i"], fields, seed)
  hypothesis.event(outcome(out))
  if isinstance(out, Sample):
    assert out.plan == T2I_PLAN


@FUZZ
@hypothesis.given(fields=mostly(edit_fields, any_fields), seed=st.integers(0, 3))
def test_edit_rows_become_samples_or_drops(transforms, fields, seed):
  out = run(transforms["edit"], fields, seed)
  hypothesis.event(outcome(out))
  if isinstance(out, Sample):
    assert out.plan[0].type == "vae_image" and out.plan[-1].loss == 1


@FUZZ
@hypothesis.given(line=lines, seed=st.integers(0, 3))
def test_vlm_lines_become_samples_or_drops(transforms, line, seed):
  out = run(transforms["vlm"], line, seed)
  hypothesis.event(outcome(out))
  if isinstance(out, Sample):
    assert all(item.enable_cfg == 0 for item in out.plan)


# A mutated TIFF may name tag data past its end: Pillow warns and skips the tag.
@pytest.mark.filterwarnings("ignore:Tag data larger than file:UserWarning")
@FUZZ
@hypothesis.given(seed_image=st.sampled_from(SEEDS), data=st.data())
def test_mutated_images_decode_or_raise_image_error(seed_image, data):
  """Flipped, inserted and cut bytes of real files: Pillow's parsers only raise ImageError."""
  blob = bytearray(seed_image)
  for _ in range(data.draw(st.integers(1, 4))):
    if not blob:
      break
    position = data.draw(st.integers(0, len(blob) - 1))
    action = data.draw(st.sampled_from(["flip", "insert", "cut"]))
    if action == "flip":
      blob[position] = data.draw(st.integers(0, 255))
    elif action == "insert":
      blob[position:position] = data.draw(st.binary(min_size=1, max_size=8))
    else:
      del blob[position:position + data.draw(st.integers(1, 64))]
  try:
    img = decode_image(bytes(blob), max_pixels_decode=MAX_DECODE)
  except ImageError as e:
    assert e.reason in {"bad_image", "too_many_pixels", "truncated_image"}
    hypothesis.event(e.reason)
  else:
    hypothesis.event("decoded")
    assert img.mode == "RGB" and img.width * img.height <= MAX_DECODE


def test_lone_surrogates_are_drops_not_tokenizer_errors(transforms):
  """JSON text escapes can spell lone surrogates; the tokenizer and the filesystem refuse them."""
  conv = '[{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "%s"}]'
  assert run(transforms["vlm"], (b'{"conversations": ' + (conv % "\\ud800").encode()
                                 + b"}")).reason == "bad_turn"
  assert run(transforms["vlm"], (b'{"image": "a\\udc00.png", "conversations": '
                                 + (conv % "ok").encode() + b"}")).reason == "wrong_type"
  assert run(transforms["t2i"], {"image": PNG, "captions": '{"a": "\\ud800"}'}).reason == \
      "bad_caption"
  assert run(transforms["edit"], {"image_list": [PNG, PNG],
                                  "instruction_list": [["\ud800"]]}).reason == "bad_edit_lists"
