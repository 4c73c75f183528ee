"""A family is one registered record: config, pipeline and converter read it and nothing else."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from bagel_grain.config import config_from_dict
from bagel_grain.configs import shipped_path
from bagel_grain.drops import RECORD_REASONS, DropReason, require
from bagel_grain.errors import ConfigError
from bagel_grain.families.base import FamilyTransform
from bagel_grain.families.edit import EditTransform
from bagel_grain.families.family import Family, GroupOptions
from bagel_grain.families.registry import FAMILIES
from bagel_grain.families.t2i import T2ITransform
from bagel_grain.families.vlm import VLMTransform
from bagel_grain.pipeline import build_pipeline, family_transform, fingerprint, group_dataset
from bagel_grain.pipeline import group_seed, group_source, pipeline_stats
from bagel_grain.sample import PlanItem, Sample
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources.records import Record
from conftest import CONFIGS
from family_records import family_dataset


def test_the_demo_groups_are_the_registered_families(demo_config):
  assert [g.family.name for g in demo_config.groups] == [g.name for g in demo_config.groups]
  assert {g.family.transform for g in demo_config.groups} == {T2ITransform, EditTransform,
                                                              VLMTransform}


def test_a_family_reads_its_format_and_builds_its_transform(demo_config, demo_tokenizer):
  for index, g in enumerate(demo_config.groups):
    (source,) = group_source(demo_config, index).sources
    assert isinstance(source, JsonlLineSource if g.name == "vlm_sft" else ParquetRowSource)
    transform = family_transform(demo_config, index, demo_tokenizer)
    assert type(transform) is g.family.transform and transform.group == index
  edit = family_transform(demo_config, 1, demo_tokenizer)
  assert edit.vae_transform == demo_config.groups[1].image_transform
  assert edit.vit_transform == demo_config.groups[1].vit_image_transform
  vlm = family_transform(demo_config, 2, demo_tokenizer)
  assert vlm.vit_transform == demo_config.groups[2].image_transform  # its one image role
  assert vlm.frame_sampler == demo_config.groups[2].options.frame_sampler
  assert vlm.data_dirs == (demo_config.groups[2].datasets[0].data_dir,)


def test_each_image_role_is_required_by_config(demo_dir):
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  for name, family in FAMILIES.items():
    for field in family.image_roles.values():
      broken = json.loads(json.dumps(raw))
      del broken["grouped_datasets"][name][f"{field}_args"]
      with pytest.raises(ConfigError, match=f"needs `{field}_args`"):
        config_from_dict(broken, base_dir=str(CONFIGS))


def test_group_dataset_is_the_family_transform_then_layout(demo_config, demo_tokenizer):
  gi = 1  # unified_edit
  prepared = group_dataset(demo_config, gi, demo_tokenizer, seed=42)
  _, samples = family_dataset(demo_config, "unified_edit", demo_tokenizer,
                              seed=group_seed(42, gi))
  for index in (0, 3, 31):
    sample = samples[index]
    assert prepared[index].key == sample.key
    assert sample.key.group == gi and sample.key.index == index
    assert prepared[index].packed_size == sample.num_tokens + 2 * len(sample.plan)


# --- a new family is one record in the table --------------------------------------------


class CaptionTransform(FamilyTransform):
  """A text-only family for the test: the `text` column after a prefix, all a loss target."""

  def __init__(self, *, prefix: str, **common):
    super().__init__(**common)
    self.prefix = prefix

  def parse(self, record, rng):
    text = record.fields.get("text")
    require(isinstance(text, str) and text != "", DropReason.WRONG_TYPE, "no text")
    ids = self.encode(self.prefix + text)
    return Sample((PlanItem("text", loss=1),), (ids,), (), len(ids), self.key(record))


@dataclasses.dataclass(frozen=True)
class CaptionOptions(GroupOptions):
  """The test family's own group key: `caption_prefix`, put before every text."""

  KEYS = frozenset({"caption_prefix"})
  prefix: str = ""

  @classmethod
  def parse(cls, raw, *, file, group):
    prefix = raw.get("caption_prefix", "")
    if not isinstance(prefix, str):
      raise ConfigError("must be a string", file=file, group=group, key="caption_prefix")
    return cls(prefix)


CAPTIONS = Family(name="caption_sft", transform=CaptionTransform, image_roles={},
                  columns=("text",), drop_reasons=RECORD_REASONS | {DropReason.WRONG_TYPE},
                  options=CaptionOptions,
                  transform_args=lambda group: {"prefix": group.options.prefix})


@pytest.fixture(name="captions")
def _captions(monkeypatch, tmp_path, demo_dir):
  """`captions(**group_keys)`: the raw config of one caption_sft group, registered."""
  monkeypatch.setitem(FAMILIES, CAPTIONS.name, CAPTIONS)
  (tmp_path / "captions").mkdir()
  texts = [f"Sentence number {i} about a red square." for i in range(30)] + [""]
  pq.write_table(pa.table({"text": texts, "other": list(range(31))}),
                 tmp_path / "captions" / "part-0.parquet", row_group_size=8)

  def raw(**group_keys):
    config = yaml.safe_load(shipped_path("demo").read_text())
    config.update(
        tokenizer_path=str(demo_dir / "tokenizer"), num_epochs=1,
        grouped_datasets={"caption_sft": {"dataset_names": ["c"], "weight": 1, **group_keys}},
        dataset_info={"caption_sft": {"c": {"data_dir": str(tmp_path / "captions")}}})
    return config
  return raw


def test_a_registered_family_runs_end_to_end(captions, demo_tokenizer):
  cfg = config_from_dict(captions(), base_dir=str(CONFIGS))
  assert cfg.groups[0].family is CAPTIONS and cfg.groups[0].options == CaptionOptions("")
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0))
  keys = [k for batch in it for k in batch["sample_keys"][0]]
  stats = pipeline_stats(it)
  it.close()
  assert len(keys) == 30 and {k[0] for k in keys} == {"caption_sft"}
  assert stats["drops"]["caption_sft"] == {"wrong_type": 1}  # the empty text


def test_a_family_declares_its_own_group_options(captions, demo_tokenizer, demo_dir):
  cfg = config_from_dict(captions(caption_prefix="Caption: "), base_dir=str(CONFIGS))
  assert cfg.groups[0].options == CaptionOptions("Caption: ")
  transform = family_transform(cfg, 0, demo_tokenizer)
  record = Record(index=0, epoch=0, record_id="c#0", dataset=0, fields={"text": "a red square"})
  np.testing.assert_array_equal(transform.parse(record, rng=None).text_ids[0],
                                demo_tokenizer.encode("Caption: a red square"))
  # The option shapes the stream: the group's fingerprint follows it, so a state saved
  # under one prefix is refused under another.
  plain = config_from_dict(captions(), base_dir=str(CONFIGS))
  [prefixed, unprefixed] = [fingerprint(c, demo_tokenizer, seed=0, shard_count=1)
                            ["config"]["groups"]["caption_sft"] for c in (cfg, plain)]
  assert prefixed["options"] != unprefixed["options"]
  with pytest.raises(ConfigError, match="must be a string.*group 'caption_sft', key "
                                        "'caption_prefix'"):
    config_from_dict(captions(caption_prefix=3), base_dir=str(CONFIGS))
  # Another family's group does not take it.
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw.update(dataset_info=str(demo_dir / "dataset_info.yaml"),
             tokenizer_path=str(demo_dir / "tokenizer"))
  raw["grouped_datasets"]["t2i_pretrain"]["caption_prefix"] = "Caption: "
  with pytest.raises(ConfigError, match="`caption_prefix` is an option of caption_sft groups "
                                        "only.*group 't2i_pretrain', key 'caption_prefix'"):
    config_from_dict(raw, base_dir=str(CONFIGS))


def test_an_unregistered_family_is_refused_by_name(demo_dir):
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw.update(tokenizer_path=str(demo_dir / "tokenizer"),
             grouped_datasets={"caption_sft": {"dataset_names": ["c"]}},
             dataset_info={"caption_sft": {"c": {"data_dir": str(demo_dir)}}})
  with pytest.raises(ConfigError, match="unknown dataset family.*vlm_sft"):
    config_from_dict(raw, base_dir=str(CONFIGS))


def _with_num_used(cfg, group_name, used):
  group = cfg.group(group_name)
  datasets = tuple(dataclasses.replace(d, num_used_data=used) for d in group.datasets)
  return dataclasses.replace(cfg, groups=tuple(
      dataclasses.replace(g, datasets=datasets) if g.name == group_name else g
      for g in cfg.groups))


def test_num_used_data_above_the_file_count_warns_once_with_the_repetition(demo_config, caplog):
  cfg = _with_num_used(demo_config, "t2i_pretrain", 40)  # the demo's T2I folder: 2 files
  with caplog.at_level("WARNING", logger="bagel_grain.families.family"):
    first = group_source(cfg, 0)
    group_source(cfg, 0)  # built again (another pipeline, another shard): no second warning
  [warning] = caplog.records
  assert ("group 't2i_pretrain', dataset 'demo_t2i': num_used_data 40 is above its 2 parquet "
          "files") in warning.getMessage()
  assert "each record is read about 20x per epoch" in warning.getMessage()
  assert len(first) == 20 * len(group_source(demo_config, 0))  # what it warns of


@pytest.mark.parametrize("used", [None, 1, 2])
def test_num_used_data_up_to_the_file_count_is_silent(demo_config, caplog, used):
  with caplog.at_level("WARNING", logger="bagel_grain.families.family"):
    group_source(_with_num_used(demo_config, "t2i_pretrain", used), 0)
  assert not caplog.records
