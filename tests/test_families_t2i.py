"""T2I rows: one caption chosen per sample, an empty caption dict kept, bad rows dropped."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bagel_grain.drops import Dropped
from bagel_grain.families.t2i import COLUMNS, T2ITransform
from bagel_grain.images import ImageTransform
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources.records import ConcatSource, ShuffledRecords
from family_records import family_dataset, make_record, shape
from hostile_images import (eps_bytes, ico_with_png, install_fake_gs, png_bytes,
                            progressive_jpeg, repeat_last_scan, spy_decoders)
from vlm_files import png

PLAN = [("text", 1, 0), ("vae_image", 0, 1)]
VAE_64 = ImageTransform(max_image_size=64, min_image_size=32, image_stride=16)


def test_t2i_plan_and_caption_choice(demo_epoch, demo_tokenizer):
  empty = 0
  for record, sample in demo_epoch("t2i_pretrain"):
    assert shape(sample) == PLAN
    assert len(sample.text_ids) == 1 and len(sample.images) == 1
    captions = list(json.loads(record.fields["captions"]).values())
    text = demo_tokenizer.decode(sample.text_ids[0])
    if captions:
      assert text in captions and sample.notes == ()
    else:
      empty += 1
      assert text == " " and sample.notes == ("empty_caption",)
    assert sample.key.record == record.record_id
  assert empty == 2  # the demo writes two rows with captions `{}`


@pytest.fixture
def t2i(demo_tokenizer):
  return T2ITransform(vae_transform=VAE_64, group=0, tokenizer=demo_tokenizer,
                      max_decode_pixels=10**7)


def test_t2i_caption_choice_changes_with_the_index(tmp_path, t2i, demo_tokenizer):
  captions = {"a": "A red square.", "b": "Red everywhere.", "c": "A plain red picture."}
  pq.write_table(pa.table({"image": [png((200, 0, 0))], "captions": [json.dumps(captions)]}),
                 tmp_path / "one.parquet")
  records = ShuffledRecords(
    ConcatSource([ParquetRowSource([str(tmp_path / "one.parquet")], COLUMNS)]), seed=0)
  samples = records.random_map(t2i, seed=0)
  chosen = [demo_tokenizer.decode(samples[i].text_ids[0]) for i in range(40)]
  assert set(chosen) == set(captions.values())  # one record, many indices: all captions
  assert chosen == [demo_tokenizer.decode(samples[i].text_ids[0]) for i in range(40)]


def test_t2i_empty_caption_dict_is_an_unconditional_sample(t2i, demo_tokenizer):
  sample = t2i.random_map(make_record({"image": png((0, 0, 200)), "captions": "{}"}),
                          np.random.default_rng(0))
  assert shape(sample) == PLAN
  assert demo_tokenizer.decode(sample.text_ids[0]) == " "
  assert sample.notes == ("empty_caption",)
  assert sample.images[0].shape == (64, 64, 3)


@pytest.mark.parametrize("captions", ["{not json", '["a list"]', '{"a": 3}', None])
def test_t2i_bad_captions(t2i, captions):
  out = t2i.random_map(make_record({"image": png((0, 0, 200)), "captions": captions}),
                       np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "bad_caption"


def test_t2i_bad_image_and_image_of_the_wrong_type(t2i):
  rng = np.random.default_rng(0)
  assert t2i.random_map(make_record({"image": b"not an image", "captions": '{"a": "x"}'}),
                        rng).reason == "bad_image"
  assert t2i.random_map(make_record({"image": "text", "captions": '{"a": "x"}'}),
                        rng).reason == "wrong_type"


def test_t2i_eps_image_is_dropped_without_starting_a_process(t2i, tmp_path, monkeypatch):
  log = install_fake_gs(tmp_path, monkeypatch)
  out = t2i.random_map(make_record({"image": eps_bytes(), "captions": '{"a": "x"}'}),
                       np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "bad_image" and "EPS" in out.detail
  assert not log.exists()


def test_t2i_ico_holding_a_large_png_is_dropped_before_decoding(t2i, monkeypatch):
  calls = spy_decoders(monkeypatch)
  ico = ico_with_png(png_bytes((2000, 2000)))  # a 16x16 directory entry over 4 Mpx
  out = t2i.random_map(make_record({"image": ico, "captions": '{"a": "x"}'}),
                       np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "bad_image" and calls == []


def test_t2i_jpeg_scan_bomb_is_dropped_before_decoding(t2i, monkeypatch):
  bomb = repeat_last_scan(progressive_jpeg((64, 64)), 1000)  # 1010 scans
  calls = spy_decoders(monkeypatch)
  out = t2i.random_map(make_record({"image": bomb, "captions": '{"a": "x"}'}),
                       np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "too_many_jpeg_scans" and calls == []


def test_t2i_rows_with_an_image_cell_over_max_image_bytes_are_dropped(demo_config,
                                                                      demo_tokenizer):
  [group] = [g for g in demo_config.groups if g.name == "t2i_pretrain"]
  sizes = [len(image) for path in sorted(Path(group.datasets[0].data_dir).glob("*.parquet"))
           for image in pq.read_table(path, columns=["image"]).column("image").to_pylist()]
  limit = int(np.median(sizes))
  cfg = dataclasses.replace(demo_config, max_image_bytes=limit)
  records, samples = family_dataset(cfg, "t2i_pretrain", demo_tokenizer, seed=0)
  too_large = [i for i in range(records.records_per_epoch) if records[i].error is not None]
  assert len(too_large) == sum(size > limit for size in sizes) > 0
  for i in too_large[:3]:  # each dropped by the family as the source's verdict, undecoded
    out = samples[i]
    assert isinstance(out, Dropped) and out.reason == "file_too_large"
    assert f"max_image_bytes {limit}" in out.detail


def test_an_image_over_max_image_bytes_is_refused_before_decoding(demo_tokenizer, monkeypatch):
  image = png((0, 0, 200))  # as a converted record carries it: bytes, whatever their size
  t2i = T2ITransform(vae_transform=VAE_64, group=0, tokenizer=demo_tokenizer,
                     max_decode_pixels=10**7, max_image_bytes=len(image) - 1)
  calls = spy_decoders(monkeypatch)
  out = t2i.random_map(make_record({"image": image, "captions": '{"a": "x"}'}),
                       np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "file_too_large" and calls == []
  t2i.max_image_bytes = len(image)
  assert not isinstance(t2i.random_map(make_record({"image": image, "captions": '{"a": "x"}'}),
                                       np.random.default_rng(0)), Dropped)
