"""ArrayRecord conversion: framed records round-trip, and samples equal the parquet/JSONL ones."""

import json
import os
import pickle
import struct

import numpy as np
import pytest
import yaml
from array_record.python import array_record_module

from bagel_grain import fs
from bagel_grain.config import config_from_dict, load_config
from bagel_grain.convert import convert_config, convert_config_file
from bagel_grain.errors import DatasetError
from bagel_grain.families.edit import EditTransform
from bagel_grain.families.t2i import T2ITransform
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.families.vlm import VLMTransform, embed_files
from bagel_grain.images import ImageTransform
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from bagel_grain.drops import Dropped
from bagel_grain.sample import Sample
from bagel_grain.sources import framing
from bagel_grain.sources.array_record import ArrayRecordSource
from bagel_grain.sources.framing import FramingError, LineWithFiles
from bagel_grain.sources.records import ConcatSource, Record, ShuffledRecords
from vlm_files import png, write_vlm_files

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
# The demo config, with num_used_data set: 3 t2i files out of 2 (one repeated), 50 of
# the VLM lines after the shuffle_lines shuffle.
NUM_USED = {"t2i_pretrain": [3], "vlm_sft": [50]}


def write_config(demo_dir, tmp_path):
  raw = yaml.safe_load(open(os.path.join(CONFIGS, "demo.yaml")).read())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  for group, used in NUM_USED.items():
    raw["grouped_datasets"][group]["num_used_data"] = used
  path = tmp_path / "config.yaml"
  path.write_text(yaml.safe_dump(raw))
  return path


@pytest.fixture(scope="module")
def converted(demo_dir, tmp_path_factory):
  """(parquet/JSONL config, the same config on its converted ArrayRecord data)."""
  tmp = tmp_path_factory.mktemp("convert")
  path = write_config(demo_dir, tmp)
  done = convert_config_file(path, tmp / "out", records_per_shard=16, progress=False)
  assert done.config == str(tmp / "out" / "config.yaml")
  return load_config(path), load_config(done.config), done


def family(cfg, name, tokenizer):
  index = [g.name for g in cfg.groups].index(name)
  g = cfg.groups[index]
  common = dict(group=index, tokenizer=tokenizer, max_decode_pixels=cfg.max_decode_pixels)
  if name == "t2i_pretrain":
    return T2ITransform(vae_transform=g.vae_transform, **common)
  if name == "unified_edit":
    return EditTransform(vae_transform=g.vae_transform, vit_transform=g.vit_transform, **common)
  return VLMTransform(vit_transform=g.vit_transform, frame_sampler=g.frame_sampler,
                      data_dirs=tuple(d.data_dir for d in g.datasets), **common)


def sources(cfg, name):
  g = cfg.group(name)
  return [g.family.source(g, d) for d in g.datasets]


def assert_same_outcome(a, b):
  """Two family outputs equal in everything but the record id."""
  assert type(a) is type(b)
  if isinstance(a, Dropped):
    assert a.reason == b.reason
    return
  assert a.plan == b.plan and a.num_tokens == b.num_tokens and a.notes == b.notes
  assert len(a.text_ids) == len(b.text_ids) and len(a.images) == len(b.images)
  for x, y in zip(a.text_ids + a.images, b.text_ids + b.images):
    np.testing.assert_array_equal(x, y)


# --- the framing ----------------------------------------------------------------------


def test_framing_round_trips_rows_and_lines():
  row = {"image": b"\x89PNG\x00\xff", "captions": '{"a": "caf\u00e9"}', "n": 3, "x": None,
         "image_list": [b"one", b"", b"three"], "instruction_list": [["a", "b"], ["c"]]}
  data = framing.encode(row, origin="f.parquet#7")
  assert data[:4] == b"BGR1"
  (header_length,) = struct.unpack_from("<I", data, 4)
  header = json.loads(data[8:8 + header_length])  # readable without this package
  assert header["origin"] == "f.parquet#7" and header["fields"]["image"] is None
  assert header["blobs"][0] == [["image"], 6]
  assert framing.decode(data) == (framing.PARQUET_ROW, row)

  line = LineWithFiles(b'{"image": "a.png"} \xff', {"a.png": b"png", "clip/f_1.jpg": b"j"},
                       {"link.png": "path_outside_data_dir"})
  assert framing.decode(framing.encode(line)) == (framing.JSONL_LINE, line)


def test_framing_refuses_what_json_cannot_hold():
  with pytest.raises(TypeError):
    framing.encode({"when": object()})
  with pytest.raises(TypeError):
    framing.encode({"m": {1: "x"}})


GOOD = framing.encode({"image": b"abc" * 10, "captions": "{}"})


@pytest.mark.parametrize("data", [
  b"", GOOD[:3], GOOD[:8], GOOD[:20], GOOD[:-1], GOOD + b"x", b"XXXX" + GOOD[4:],
  GOOD[:4] + struct.pack("<I", 10**6) + GOOD[8:],
  GOOD[:8] + b"{" * (len(GOOD) - 8),
  framing.encode({"a": None})[:-2] + b"]]",  # header JSON cut
  framing.encode({"a": [None]}).replace(b'"blobs":[]', b'"blobs":[[["a",5],0]]'),
  framing.encode({"a": "x"}).replace(b'"blobs":[]', b'"blobs":[[["a"],0]]'),
  framing.encode({"a": 1}).replace(b'"parquet_row"', b'"pickle"'),
  framing.encode(LineWithFiles(b"x")).replace(b'"files":{}', b'"files":[]'),
  # a file's verdict that is no drop reason, or not a string at all
  framing.encode(LineWithFiles(b"x", {}, {"a.png": "missing_file"})).replace(
      b'"missing_file"', b'"disk_on_fire"'),
  framing.encode(LineWithFiles(b"x", {}, {"a.png": "missing_file"})).replace(
      b'"missing_file"', b'["missing_file"]'),
], ids=range(16))
def test_framing_rejects_damaged_records(data):
  with pytest.raises(FramingError):
    framing.decode(data)


def write_array_record(path, records):
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for record in records:
    writer.write(record)
  writer.close()
  return str(path)


def test_a_damaged_record_is_dropped_with_its_reason(tmp_path, demo_tokenizer):
  good = framing.encode({"image": png(), "captions": '{"a": "a red square"}'})
  path = write_array_record(tmp_path / "x.array_record", [good, good[:-5], b"junk", good])
  source = ArrayRecordSource([path])
  records = ShuffledRecords(ConcatSource([source]), seed=0, num_epochs=1)
  t2i = T2ITransform(vae_transform=ImageTransform(max_image_size=64, min_image_size=32,
                                                  image_stride=16),
                     group=0, tokenizer=demo_tokenizer, max_decode_pixels=10**7)
  outcomes = {r.record_id: t2i.random_map(r, np.random.default_rng(0))
              for r in (records[i] for i in range(len(records)))}
  assert sorted(outcomes) == [f"{path}:{i}" for i in range(4)]
  assert isinstance(outcomes[f"{path}:0"], Sample) and isinstance(outcomes[f"{path}:3"], Sample)
  for i in (1, 2):
    assert outcomes[f"{path}:{i}"].reason == "corrupt_record"
    assert outcomes[f"{path}:{i}"].detail  # says what is wrong


def test_a_truncated_file_is_a_build_error(tmp_path):
  path = write_array_record(tmp_path / "x.array_record", [GOOD] * 3)
  data = open(path, "rb").read()
  open(path, "wb").write(data[:len(data) // 2])
  with pytest.raises(DatasetError, match="truncated"):
    ArrayRecordSource([path])




# --- conversion of the demo data ------------------------------------------------------


def test_written_dataset_info_points_at_the_shards(converted):
  original, arrays, done = converted
  for g_orig, g_ar in zip(original.groups, arrays.groups):
    assert g_orig.name == g_ar.name and g_orig.weight == g_ar.weight
    for d_orig, d_ar in zip(g_orig.datasets, g_ar.datasets):
      assert d_ar.name == d_orig.name and d_ar.jsonl_path is None
      assert d_ar.num_used_data == d_orig.num_used_data  # same grouped_datasets
      assert os.path.isdir(d_ar.array_record_path)
  by_name = {d.name: d for d in done.datasets}
  assert by_name["demo_t2i"].num_records == 40 + 36 + 40  # 3 files: the first repeated
  assert len(by_name["demo_t2i"].files) == 8  # 16 records per shard
  assert by_name["demo_vlm"].num_records == 50


@pytest.mark.parametrize("name", ["t2i_pretrain", "unified_edit", "vlm_sft"])
def test_converted_records_equal_the_originals(converted, name):
  original, arrays, _ = converted
  (before,), (after,) = sources(original, name), sources(arrays, name)
  assert len(after) == len(before)
  assert after.block_sizes().tolist() == [1] * len(after)  # global shuffling
  data_dir = original.group(name).datasets[0].data_dir
  embedded = 0
  for i in range(len(before)):
    assert after.record_id(i).endswith(f".array_record:{i % 16}")
    if name != "vlm_sft":
      assert after[i] == before[i]  # every column; images byte-identical
      continue
    line = after[i]
    assert line.line == before[i] and line.file_errors == {}
    row = json.loads(line.line)
    if "image" in row:
      listed = row["image"] if isinstance(row["image"], list) else [row["image"]]
    elif "video" in row:
      folder = os.path.join(data_dir, row["video"])
      listed = [row["video"] + f for f in sorted(os.listdir(folder))]
    else:
      listed = []
    assert sorted(line.files) == sorted(set(listed))
    for relative in listed:
      assert line.files[relative] == fs.read_bytes(os.path.join(data_dir, relative))
      embedded += 1
  if name == "vlm_sft":
    assert embedded > 50


def test_source_pickles_for_workers(converted):
  _, arrays, _ = converted
  (source,) = sources(arrays, "unified_edit")
  copy = pickle.loads(pickle.dumps(source))
  assert len(copy) == len(source) and copy[5] == source[5]


@pytest.mark.parametrize("name", ["t2i_pretrain", "unified_edit", "vlm_sft"])
def test_samples_equal_through_both_sources(converted, demo_tokenizer, name):
  original, arrays, _ = converted
  (before,), (after,) = sources(original, name), sources(arrays, name)
  from_disk, from_records = family(original, name, demo_tokenizer), family(arrays, name,
                                                                           demo_tokenizer)
  samples = 0
  for i in range(len(before)):
    for seed in (i, i + 1000):  # the same choices (caption, chain, frames) from the same rng
      a = from_disk.random_map(Record(i, 0, "disk", 0, before[i]), np.random.default_rng(seed))
      b = from_records.random_map(Record(i, 0, "ar", 0, after[i]), np.random.default_rng(seed))
      assert_same_outcome(a, b)
      samples += isinstance(a, Sample)
  assert samples > len(before)  # mostly samples, not drops


def test_pipeline_on_converted_data(converted, demo_tokenizer):
  original, arrays, _ = converted
  it = iter(build_pipeline(arrays, demo_tokenizer, batch_size=2))
  reference = next(iter(build_pipeline(original, demo_tokenizer, batch_size=2)))
  for _ in range(4):
    batch = next(it)
    for key, value in reference.items():
      if key != "sample_keys":
        assert batch[key].shape == value.shape and batch[key].dtype == value.dtype
    assert (batch["num_samples"] > 0).all()
    assert all(".array_record:" in k[-1] for keys in batch["sample_keys"] for k in keys)
  stats = pipeline_stats(it)
  assert stats["packed"] > 0 and set(stats["epoch"]) == {g.name for g in arrays.groups}

def test_converting_into_a_used_folder_needs_overwrite(converted):
  original, _, done = converted
  with pytest.raises(DatasetError, match="overwrite"):
    convert_config(original, os.path.dirname(done.dataset_info))


def test_array_record_path_alone_is_a_dataset(converted, demo_dir):
  _, arrays, done = converted
  info = {g.name: {d.name: {"array_record_path": d.array_record_path} for d in g.datasets}
          for g in arrays.groups}
  raw = yaml.safe_load(open(os.path.join(CONFIGS, "demo.yaml")).read())
  raw.update(dataset_info=info, tokenizer_path=str(demo_dir / "tokenizer"))
  cfg = config_from_dict(raw)
  spec = cfg.group("vlm_sft").datasets[0]
  assert spec.jsonl_path is None and spec.data_dir == spec.array_record_path


# --- VLM files: the same verdicts from the records as from the disk ---------------------


@pytest.fixture
def vlm_data(tmp_path, demo_tokenizer):
  data = write_vlm_files(tmp_path)
  (data / "clip" / "notes.txt").write_text("not a frame")
  (data / "empty_clip").mkdir()
  (data / "junk.mp4").write_bytes(b"not a video")
  vit = ImageTransform(max_image_size=224, min_image_size=28, image_stride=14,
                       max_pixels=112 * 112)
  transform = VLMTransform(vit_transform=vit, frame_sampler=FrameSamplerArgs(5, 3),
                           data_dirs=(str(data),), group=0, tokenizer=demo_tokenizer,
                           max_decode_pixels=10**7)
  return data, transform


def chat(first="<image>\nWhat is it?"):
  return [{"from": "human", "value": first}, {"from": "gpt", "value": "A picture."}]


@pytest.mark.parametrize("row,reason", [
  ({"image": "a.png", "conversations": chat()}, None),
  ({"image": ["a.png", "a.png", "corrupt.png"], "conversations": chat()}, None),
  ({"image": "nope.png", "conversations": chat()}, "missing_file"),
  ({"image": ["a.png", "nope.png"], "conversations": chat()}, None),  # unused, never opened
  ({"image": "corrupt.png", "conversations": chat()}, "bad_image"),
  ({"image": "link.png", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": ["a.png", "link.png"], "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "../outside.png", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "/etc/hostname", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "clip/../../outside.png", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "", "conversations": chat()}, "wrong_type"),
  ({"image": 3, "conversations": chat()}, "wrong_type"),
  ({"video": "clip/", "conversations": chat("<video>\nWhat happens?")}, None),
  ({"video": "empty_clip/", "conversations": chat("<video>")}, "video_unreadable"),
  ({"video": "../data/../", "conversations": chat("<video>")}, "path_outside_data_dir"),
  ({"video": "nope.mp4", "conversations": chat("<video>")}, "missing_file"),
  ({"video": "junk.mp4", "conversations": chat("<video>")}, "video_unreadable"),
  ({"conversations": chat("Hello?")}, None),
  ('{"image": "a.png", "conversations": [', "bad_json"),
], ids=range(19))
def test_embedded_files_give_the_disk_verdict(vlm_data, row, reason):
  data, transform = vlm_data
  line = (row if isinstance(row, str) else json.dumps(row)).encode()
  _, record = framing.decode(framing.encode(embed_files(line, str(data))))
  for seed in range(4):
    a = transform.random_map(Record(0, 0, "disk", 0, line), np.random.default_rng(seed))
    b = transform.random_map(Record(0, 0, "ar", 0, record), np.random.default_rng(seed))
    assert_same_outcome(a, b)
    assert (a.reason if isinstance(a, Dropped) else None) == reason


def test_embedded_video_folder_holds_its_frames_only(vlm_data):
  data, _ = vlm_data
  line = json.dumps({"video": "clip/", "conversations": chat("<video>")}).encode()
  record = embed_files(line, str(data))
  assert sorted(record.files) == sorted(f"clip/frame_{n}.jpg" for n in range(1, 11))
  assert record.file_errors == {}


def test_missing_frame_folder_is_a_missing_file(vlm_data):
  data, transform = vlm_data
  line = json.dumps({"video": "gone/", "conversations": chat("<video>")}).encode()
  record = embed_files(line, str(data))
  assert record.file_errors == {"gone/": "missing_file"}
  out = transform.random_map(Record(0, 0, "ar", 0, record), np.random.default_rng(0))
  assert out.reason == "missing_file"


def test_a_path_with_a_lone_surrogate_converts_and_drops_as_on_disk(vlm_data):
  data, transform = vlm_data
  line = json.dumps({"image": "a\udc00.png", "conversations": chat()}).encode()
  record = embed_files(line, str(data))
  framing.encode(record)  # no UnicodeEncodeError
  out = transform.random_map(Record(0, 0, "ar", 0, record), np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "wrong_type"
