"""NeMo AutoModel recipe files load as they are: data settings read, trainer sections ignored."""

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from bagel_grain.config import load_config
from bagel_grain.configs import shipped_path
from bagel_grain.errors import ConfigError
from bagel_grain.packing import to_bagel_dict
from bagel_grain.pipeline import build_pipeline, group_records, stream_seeds
from bagel_grain.tokenizer import load_tokenizer

RECIPE = Path(__file__).parent / "recipes" / "nemo_bagel.yaml"
# The top-level sections of NeMo's BAGEL pretraining and fine-tuning recipes.
NEMO_SECTIONS = ["recipe", "seed", "step_scheduler", "dist_env", "tokenizer", "model",
                 "checkpoint", "distributed", "dataset", "dataloader", "optimizer",
                 "lr_scheduler", "clip_grad_norm", "freeze_config", "ema", "wandb"]


@pytest.fixture
def recipe(demo_dir):
  """The recipe as a dict, its data paths pointing at the demo data."""
  return yaml.safe_load(RECIPE.read_text().replace("DEMO_DATA", str(demo_dir)))


def _load(recipe, tmp_path):
  path = tmp_path / "recipe.yaml"
  path.write_text(yaml.safe_dump(recipe, sort_keys=False))
  return load_config(path), str(path)


def _set(raw, dotted, value):
  *parents, last = dotted.split(".")
  for key in parents:
    raw = raw[key]
  raw[last] = value


def test_fixture_has_every_section_of_nemos_recipes(recipe):
  assert list(recipe) == NEMO_SECTIONS


def test_recipe_loads_with_its_data_settings(recipe, tmp_path, demo_dir):
  cfg, _ = _load(recipe, tmp_path)
  assert Path(cfg.tokenizer_path) == demo_dir / "tokenizer"
  assert (cfg.num_workers, cfg.batch_size, cfg.seed, cfg.use_flex) == (2, 3, 1234, True)
  assert (cfg.expected_num_tokens, cfg.max_num_tokens, cfg.data_seed) == (4096, 5120, 11)
  assert (cfg.text_cond_dropout_prob, cfg.vit_cond_dropout_prob,
          cfg.vae_cond_dropout_prob) == (0.2, 0.25, 0.15)
  assert [(g.name, g.weight) for g in cfg.groups] == [
    ("t2i_pretrain", 2.0), ("unified_edit", 1.0), ("vlm_sft", 1.0)]
  vlm = cfg.group("vlm_sft")
  assert (vlm.image_transform.max_pixels, vlm.options.frame_sampler.max_num_frames,
          vlm.shuffle_seed, vlm.datasets[0].num_used_data) == (78_400, 4, 3, 40)


def test_recipe_packs_batches_of_its_local_batch_size(recipe, tmp_path):
  cfg, _ = _load(recipe, tmp_path)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  it = iter(build_pipeline(cfg, tokenizer, workers=0))
  try:
    batch = next(it)
  finally:
    it.close()
  assert batch["text_ids"].shape == (3, 5120)  # local_batch_size rows, L = 5120
  assert all(0 < n <= 5120 for n in batch["num_tokens"])
  row = {k: v[0] for k, v in batch.items() if k != "sample_keys"}
  flex = to_bagel_dict(row, use_flex=cfg.use_flex)
  # With use_flex the padding up to L is one final causal split.
  assert flex["sample_lens"][-1] == 5120 - int(row["num_tokens"])


def test_trainer_sections_are_logged_once_as_ignored(recipe, tmp_path, caplog):
  with caplog.at_level(logging.INFO, logger="bagel_grain"):
    _, path = _load(recipe, tmp_path)
  lines = [r.getMessage() for r in caplog.records if r.name == "bagel_grain.recipe"]
  trainer = ", ".join(s for s in NEMO_SECTIONS if s not in ("seed", "dataset"))
  assert lines == [
    f"{path}: ignoring trainer sections {trainer} (read from them: "
    "tokenizer.pretrained_model_name_or_path, dataloader.num_workers, "
    "step_scheduler.local_batch_size)"]
  # A warning: settings in the user's file that have no effect here.
  assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_plain_config_logs_nothing(demo_dir, tmp_path, caplog):
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")  # a clone has no .demo_data/
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  (tmp_path / "demo.yaml").write_text(yaml.safe_dump(raw))
  with caplog.at_level(logging.INFO, logger="bagel_grain"):
    load_config(tmp_path / "demo.yaml", tokenizer_path=str(demo_dir / "tokenizer"))
  assert not [r for r in caplog.records if r.name == "bagel_grain.recipe"]


@pytest.mark.parametrize("dotted, value, message, group, key", [
  ("dataset.max_num_token", 4096, "unknown key under `dataset:`; did you mean `max_num_tokens`?",
   None, "dataset.max_num_token"),
  ("dataset.grouped_datasets.vlm_sft.shuffle_line", True, "did you mean `shuffle_lines`?", "vlm_sft",
   "shuffle_line"),
  ("dataset.dataset_info.t2i_pretrain.demo_t2i.num_file", 2, "did you mean `num_files`?",
   "t2i_pretrain",
   "num_file"),
  ("dataset.use_flex", "yes", "must be true or false", None, "dataset.use_flex"),
  ("dataloader.num_workers", 1.5, "whole number", None, "dataloader.num_workers"),
  ("step_scheduler.local_batch_size", "four", "whole number", None,
   "step_scheduler.local_batch_size"),
  ("optimiser", {"lr": 1.0}, "unknown top-level key", None, "optimiser"),
])
def test_a_typo_in_the_data_settings_is_refused(recipe, tmp_path, dotted, value, message,
                                                 group, key):
  _set(recipe, dotted, value)
  with pytest.raises(ConfigError, match=re.escape(message)) as e:
    _load(recipe, tmp_path)
  assert (e.value.file, e.value.group, e.value.key) == (str(tmp_path / "recipe.yaml"), group, key)


def test_a_setting_given_twice_is_refused(recipe, tmp_path):
  recipe["dataset"]["num_workers"] = 0
  with pytest.raises(ConfigError, match=r"given twice.*key 'dataloader\.num_workers'"):
    _load(recipe, tmp_path)


def test_a_hub_id_as_tokenizer_asks_for_a_local_copy(recipe, tmp_path):
  recipe["tokenizer"]["pretrained_model_name_or_path"] = "Qwen/Qwen2.5-7B-Instruct"
  with pytest.raises(ConfigError) as e:
    _load(recipe, tmp_path)
  assert e.value.key == "tokenizer.pretrained_model_name_or_path"
  assert "looks like a Hugging Face Hub id" in str(e.value)
  assert "hf download Qwen/Qwen2.5-7B-Instruct --local-dir" in str(e.value)


def test_without_a_tokenizer_section_the_model_folder_gives_the_tokenizer(recipe, tmp_path,
                                                                           demo_dir):
  # NeMo's fine-tuning recipe has no `tokenizer:`; its trainer uses the model's folder.
  del recipe["tokenizer"]
  recipe["model"]["pretrained_model_name_or_path"] = str(demo_dir / "tokenizer")
  cfg, _ = _load(recipe, tmp_path)
  assert Path(cfg.tokenizer_path) == demo_dir / "tokenizer"
  del recipe["model"]["pretrained_model_name_or_path"]
  cfg, _ = _load(recipe, tmp_path)
  assert cfg.tokenizer_path is None


def test_dataset_sections_may_be_files_under_nemos_path_keys(recipe, tmp_path):
  info = tmp_path / "info.yaml"
  info.write_text(yaml.safe_dump(recipe["dataset"].pop("dataset_info")))
  recipe["dataset"]["dataset_info_path"] = str(info)
  cfg, _ = _load(recipe, tmp_path)
  assert cfg.group("unified_edit").datasets[0].parquet_info_path.endswith("parquet_info.json")


def test_load_tokenizer_without_a_path_names_the_keys_that_set_it():
  with pytest.raises(ConfigError) as e:
    load_tokenizer(None)
  for key in ("`tokenizer_path`", "`tokenizer.pretrained_model_name_or_path`",
              "`model.pretrained_model_name_or_path`"):
    assert key in str(e.value)


# --- seeds: NeMo orders records with `data_seed` and samples with the global `seed` ------


def test_stream_seeds_follow_nemo():
  class Cfg:  # only the two fields stream_seeds reads
    data_seed, seed = 11, None
  assert stream_seeds(Cfg) == (11, 11)
  Cfg.seed = 1234
  assert stream_seeds(Cfg) == (11, 1234)
  assert stream_seeds(Cfg, seed=5) == (5, 5)


def _record_ids(cfg, group, n=20):
  """The first records of a group in the order build_pipeline reads them."""
  records = group_records(cfg, group, seed=stream_seeds(cfg)[0])
  return [records[i].record_id for i in range(n)]


def _first_rows(cfg, tokenizer):
  it = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers=0))
  try:
    return next(it)["text_ids"]
  finally:
    it.close()


def test_global_seed_changes_the_sampling_not_the_record_order(recipe, tmp_path):
  recipe["seed"] = None
  recipe["dataset"]["data_seed"] = 1234
  unset, _ = _load(recipe, tmp_path)
  recipe["seed"] = 1234
  same, _ = _load(recipe, tmp_path)
  recipe["seed"] = 99
  other, _ = _load(recipe, tmp_path)
  tokenizer = load_tokenizer(unset.tokenizer_path)
  # A seed equal to data_seed is the stream of a config without one.
  np.testing.assert_array_equal(_first_rows(unset, tokenizer), _first_rows(same, tokenizer))
  assert not np.array_equal(_first_rows(same, tokenizer), _first_rows(other, tokenizer))
  for group in range(3):
    assert _record_ids(same, group) == _record_ids(other, group)
  recipe["dataset"]["data_seed"] = 5
  reordered, _ = _load(recipe, tmp_path)
  assert _record_ids(reordered, 0) != _record_ids(other, 0)


@pytest.mark.parametrize("section", ["tokenizer", "model"])
def test_a_hub_id_from_either_key_loads_from_the_local_cache(recipe, tmp_path, demo_dir,
                                                             monkeypatch, section):
  from test_tokenizer_path import fake_hub_cache  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  snapshot = fake_hub_cache(tmp_path / "hub", "ByteDance-Seed/BAGEL-7B-MoT",
                            demo_dir / "tokenizer")
  if section == "model":
    del recipe["tokenizer"]  # NeMo's fine-tuning recipe: the model's id gives the tokenizer
  recipe[section]["pretrained_model_name_or_path"] = "ByteDance-Seed/BAGEL-7B-MoT"
  cfg, _ = _load(recipe, tmp_path)
  assert Path(cfg.tokenizer_path) == snapshot
  assert load_tokenizer(cfg.tokenizer_path).special == load_tokenizer(
      demo_dir / "tokenizer").special


@pytest.mark.parametrize("section", ["tokenizer", "model"])
def test_a_hub_id_not_in_the_cache_gives_one_error_whichever_key(recipe, tmp_path, monkeypatch,
                                                                 section):
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hub"))
  if section == "model":
    del recipe["tokenizer"]
  recipe[section]["pretrained_model_name_or_path"] = "ByteDance-Seed/BAGEL-7B-MoT"
  with pytest.raises(ConfigError) as e:
    _load(recipe, tmp_path)
  assert e.value.key == f"{section}.pretrained_model_name_or_path"
  message = str(e.value)
  assert f"not in the local Hugging Face cache ({tmp_path / 'empty_hub'})" in message
  assert "`hf download ByteDance-Seed/BAGEL-7B-MoT` into that cache" in message
