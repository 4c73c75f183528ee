"""What every family transform shares: the sample contract, determinism, a source's drop."""

import numpy as np
import pytest

from bagel_grain.drops import Dropped, DropReason
from bagel_grain.families.base import is_text
from bagel_grain.families.t2i import T2ITransform
from bagel_grain.images import ImageTransform
from bagel_grain.sample import Sample
from family_records import family_dataset, make_record

FAMILY_NAMES = ["t2i_pretrain", "unified_edit", "vlm_sft"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_demo_rows_all_become_samples(demo_epoch, name):
  dropped = [s for _, s in demo_epoch(name) if not isinstance(s, Sample)]
  assert dropped == []


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_num_tokens_and_image_geometry(demo_epoch, demo_config, name):
  g = demo_config.group(name)
  for _, sample in demo_epoch(name):
    strides, limits = [], []
    for item in sample.plan:
      if item.type != "text":
        t = g.vae_transform if item.type == "vae_image" else g.vit_transform
        strides.append(t.image_stride)
        limits.append(t.max_image_size)
    assert len(sample.images) == len(strides)
    expected = sum(len(ids) for ids in sample.text_ids)
    for image, stride, limit in zip(sample.images, strides, limits):
      assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
      h, w = image.shape[:2]
      assert h % stride == 0 and w % stride == 0 and h >= stride and w >= stride
      assert max(h, w) <= limit
      expected += h * w // stride**2
    assert all(ids.dtype == np.int32 and len(ids) > 0 for ids in sample.text_ids)
    assert sample.num_tokens == expected
    assert sample.packed_size == expected + 2 * len(sample.plan)


def _assert_same(a, b):
  assert a.key == b.key and a.plan == b.plan and a.num_tokens == b.num_tokens
  assert a.notes == b.notes
  assert len(a.text_ids) == len(b.text_ids) and len(a.images) == len(b.images)
  for x, y in zip(a.text_ids + a.images, b.text_ids + b.images):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_same_seed_and_index_give_the_same_sample(demo_config, demo_tokenizer, name):
  _, first = family_dataset(demo_config, name, demo_tokenizer, seed=4)
  _, again = family_dataset(demo_config, name, demo_tokenizer, seed=4)
  for index in (0, 7, 29, 95):  # 95 is in a later epoch for every group
    _assert_same(first[index], again[index])
  _, other = family_dataset(demo_config, name, demo_tokenizer, seed=5)
  assert [first[i].key.record for i in range(8)] != [other[i].key.record for i in range(8)]


def test_a_record_the_source_could_not_read_is_dropped_at_its_key(demo_tokenizer):
  t2i = T2ITransform(vae_transform=ImageTransform(max_image_size=64, min_image_size=32,
                                                  image_stride=16),
                     group=3, tokenizer=demo_tokenizer, max_decode_pixels=10**7)
  unreadable = Dropped(DropReason.UNREADABLE_FILE, "gone")
  out = t2i.random_map(make_record(None, error=unreadable), np.random.default_rng(0))
  assert (out.reason, out.detail) == ("unreadable_file", "gone")
  assert (out.key.group, out.key.record) == (3, "mem.parquet#0")


def test_text_is_a_string_utf8_can_hold():
  assert is_text("caf\u00e9") and is_text("")
  assert not is_text("\ud800 lone surrogate")  # JSON's escapes can make one
  assert not is_text(b"bytes") and not is_text(None) and not is_text(3)
