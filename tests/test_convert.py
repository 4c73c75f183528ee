"""Conversion to ArrayRecord: the records a group reads, framed; samples equal the originals."""

import json
import os

import numpy as np
import pytest
import yaml

from bagel_grain import fs
from bagel_grain.config import config_from_dict, load_config
from bagel_grain.tooling.convert import convert_config, convert_config_file
from bagel_grain.errors import DatasetError
from bagel_grain.pipeline import build_pipeline, family_transform, pipeline_stats
from bagel_grain.sample import Sample
from bagel_grain.sources.records import Record
from family_records import assert_same_outcome

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "bagel_grain", "configs")
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
  return family_transform(cfg, [g.name for g in cfg.groups].index(name), tokenizer)


def sources(cfg, name):
  g = cfg.group(name)
  return [g.family.source(g, d) for d in g.datasets]


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
