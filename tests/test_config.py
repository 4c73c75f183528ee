"""Loading BAGEL/NeMo YAML configs: the shipped files, path resolution, and clear errors."""

import os
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from bagel_grain.config import config_from_dict, load_config
from bagel_grain.configs import load_shipped, shipped_path
from bagel_grain.errors import ConfigError, DatasetError
from bagel_grain.pipeline import build_pipeline

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
UPSTREAM_MAX_PIXELS = 14 * 14 * 9 * 1024


def _roles(cfg):
  """Per group: (VAE stride, ViT stride); None where the family has no such transform."""
  return {g.name: (g.vae_transform and g.vae_transform.image_stride,
                   g.vit_transform and g.vit_transform.image_stride) for g in cfg.groups}


def test_example_yaml_loads_with_upstream_values(load_redirected, demo_dir):
  cfg = load_redirected("example.yaml")
  assert [g.name for g in cfg.groups] == ["t2i_pretrain", "unified_edit", "vlm_sft"]
  assert (cfg.expected_num_tokens, cfg.max_num_tokens, cfg.max_num_tokens_per_sample) == (
    32768, 36864, 16384)
  assert (cfg.text_cond_dropout_prob, cfg.vit_cond_dropout_prob,
          cfg.vae_cond_dropout_prob) == (0.1, 0.3, 0.3)
  assert (cfg.max_latent_size, cfg.max_num_patch_per_side, cfg.interpolate_pos) == (64, 70, False)
  assert _roles(cfg) == {"t2i_pretrain": (16, None), "unified_edit": (16, 14),
                         "vlm_sft": (None, 14)}
  t2i, edit, vlm = cfg.groups
  assert vlm.vit_transform.max_pixels == 2007040
  assert vlm.vit_transform.max_image_size == 980 and vlm.vit_transform.min_image_size == 378
  assert t2i.vae_transform.max_pixels == UPSTREAM_MAX_PIXELS  # not given: upstream default
  assert edit.vit_transform.max_image_size == 518
  assert [g.is_mandatory for g in cfg.groups] == [True, False, True]
  assert [g.datasets[0].num_used_data for g in cfg.groups] == [10, 10, 1000]
  frames = vlm.options.frame_sampler
  assert (frames.min_num_frames, frames.max_num_frames) == (8, 12)
  assert vlm.shuffle_lines and vlm.shuffle_seed == 0
  assert cfg.vae_image_size == 1024
  assert Path(t2i.datasets[0].data_dir) == demo_dir / "t2i"
  assert Path(vlm.datasets[0].jsonl_path) == demo_dir / "vlm" / "sft.jsonl"
  assert Path(edit.datasets[0].parquet_info_path) == demo_dir / "edit" / "parquet_info.json"


def test_demo_yaml_loads(demo_config, demo_dir):
  cfg = demo_config
  assert (cfg.expected_num_tokens, cfg.max_num_tokens, cfg.max_num_tokens_per_sample) == (
    8192, 10240, 8192)
  assert (cfg.prefer_buffer_before, cfg.max_buffer_size) == (4096, 16)
  assert (cfg.text_cond_dropout_prob, cfg.vit_cond_dropout_prob,
          cfg.vae_cond_dropout_prob) == (0.1, 0.3, 0.3)
  assert _roles(cfg) == {"t2i_pretrain": (16, None), "unified_edit": (16, 14),
                         "vlm_sft": (None, 14)}
  assert cfg.vae_image_size == 512
  assert cfg.group("vlm_sft").options.frame_sampler.max_num_frames == 6
  assert cfg.group("vlm_sft").vit_transform.max_pixels == UPSTREAM_MAX_PIXELS
  assert Path(cfg.tokenizer_path) == demo_dir / "tokenizer"


def test_shipped_file_loads_unchanged_from_its_own_folder(tmp_path, demo_dir):
  # configs/example.yaml names ../.demo_data: recreate that layout around a copy.
  (tmp_path / "configs").mkdir()
  shutil.copy(CONFIGS / "example.yaml", tmp_path / "configs" / "example.yaml")
  (tmp_path / ".demo_data").symlink_to(demo_dir, target_is_directory=True)
  cfg = load_config(tmp_path / "configs" / "example.yaml")
  assert os.path.samefile(cfg.tokenizer_path, demo_dir / "tokenizer")
  assert os.path.samefile(cfg.group("vlm_sft").datasets[0].jsonl_path,
                          demo_dir / "vlm" / "sft.jsonl")
  assert load_config(tmp_path / "configs" / "example.yaml", num_workers=3).num_workers == 3


# --- a small valid config, edited to make each error ----------------------------------


@pytest.fixture
def root(tmp_path):
  for folder in ("t2i", "edit", "vlm"):
    (tmp_path / folder).mkdir()
  (tmp_path / "vlm" / "sft.jsonl").write_text("")
  return tmp_path


def minimal():
  """Three groups; dataset_info paths relative to the config's base_dir."""
  return {
    "dataset_info": {
      "t2i_pretrain": {"demo_t2i": {"data_dir": "t2i", "num_files": 2}},
      "unified_edit": {"demo_edit": {"data_dir": "edit"}},
      "vlm_sft": {"demo_vlm": {"data_dir": "vlm", "jsonl_path": "vlm/sft.jsonl"}},
    },
    "grouped_datasets": {
      "t2i_pretrain": {
        "dataset_names": ["demo_t2i"], "weight": 2,
        "image_transform_args": {"image_stride": 16, "max_image_size": 512,
                                 "min_image_size": 256}},
      "unified_edit": {
        "dataset_names": ["demo_edit"], "resume_data_status": True,
        "image_transform_args": {"image_stride": 16, "max_image_size": 384,
                                 "min_image_size": 192},
        "vit_image_transform_args": {"image_stride": 14, "max_image_size": 378,
                                     "min_image_size": 196}},
      "vlm_sft": {
        "dataset_names": ["demo_vlm"],
        "image_transform_args": {"image_stride": 14, "max_image_size": 490,
                                 "min_image_size": 224}},
    },
  }


def test_minimal_config_is_valid(root):
  cfg = config_from_dict(minimal(), file="main.yaml", base_dir=str(root))
  assert cfg.group("t2i_pretrain").weight == 2.0
  assert Path(cfg.group("t2i_pretrain").datasets[0].data_dir) == root / "t2i"
  assert cfg.max_latent_size == 32 and cfg.max_num_patch_per_side == 70  # upstream defaults


def test_frame_sampler_takes_upstreams_modes(root):
  raw = minimal()
  vlm = raw["grouped_datasets"]["vlm_sft"]
  cfg = config_from_dict(raw, file="main.yaml", base_dir=str(root))
  assert cfg.group("vlm_sft").options.frame_sampler.sample == "rand"  # upstream's default
  assert cfg.max_video_bytes == 1 << 30 and cfg.max_video_frames == 4096
  for sample in ("rand", "middle", "fps0.5", "fps2"):
    vlm["frame_sampler_args"] = {"max_num_frames": 6, "min_num_frames": 6, "sample": sample}
    frames = config_from_dict(raw, file="main.yaml", base_dir=str(root)).group(
        "vlm_sft").options.frame_sampler
    assert (frames.sample, frames.min_num_frames, frames.max_num_frames) == (sample, 6, 6)


def _set(raw, dotted, value):
  *parents, last = dotted.split(".")
  for key in parents:
    raw = raw[key]
  raw[last] = value


def _where(group, key):
  return re.escape(f"group {group!r}, key {key!r}" if group else f"key {key!r}")


T2I, EDIT, VLM = "grouped_datasets.t2i_pretrain", "grouped_datasets.unified_edit", \
  "grouped_datasets.vlm_sft"

ERRORS = {
  "unknown_top_level_key": ("max_tokens", 4096,
                            "unknown top-level key.*" + _where(None, "max_tokens")),
  "unknown_group_key": (f"{T2I}.image_size", 512, _where("t2i_pretrain", "image_size")),
  "unknown_family": ("grouped_datasets.text_pretrain", {"dataset_names": ["x"]},
                     "unknown dataset family.*" + _where("text_pretrain", "text_pretrain")),
  "missing_data_dir": ("dataset_info.t2i_pretrain.demo_t2i.data_dir", "no_such_dir",
                       "path does not exist.*no_such_dir.*"
                       + _where("t2i_pretrain", "demo_t2i.data_dir")),
  "weight_word": (f"{T2I}.weight", "heavy", "got 'heavy'.*" + _where("t2i_pretrain", "weight")),
  "weight_bool": (f"{VLM}.weight", True, "got True.*" + _where("vlm_sft", "weight")),
  "vae_stride": (f"{T2I}.image_transform_args.image_stride", 8,
                 "stride 8 must equal vae_image_downsample 16.*"
                 + _where("t2i_pretrain", "image_transform_args.image_stride")),
  "edit_vit_stride": (f"{EDIT}.vit_image_transform_args.image_stride", 16,
                      "stride 16 must equal vit_patch_size 14.*"
                      + _where("unified_edit", "vit_image_transform_args.image_stride")),
  "vlm_vit_stride": (f"{VLM}.image_transform_args.image_stride", 16,
                     "stride 16 must equal vit_patch_size 14.*"
                     + _where("vlm_sft", "image_transform_args.image_stride")),
  # 1024 / 16 = 64 latents per side > max_latent_size 32.
  "vae_too_large": (f"{T2I}.image_transform_args.max_image_size", 1024,
                    "exceeds max_latent_size 32.*"
                    + _where("t2i_pretrain", "image_transform_args.max_image_size")),
  # 994 / 14 = 71 patches per side > 70.
  "edit_vit_too_large": (f"{EDIT}.vit_image_transform_args.max_image_size", 994,
                         "exceeds max_num_patch_per_side 70.*"
                         + _where("unified_edit", "vit_image_transform_args.max_image_size")),
  "vlm_vit_too_large": (f"{VLM}.image_transform_args.max_image_size", 994,
                        "exceeds max_num_patch_per_side 70.*"
                        + _where("vlm_sft", "image_transform_args.max_image_size")),
  "frames_min_over_max": (f"{VLM}.frame_sampler_args", {"max_num_frames": 4, "min_num_frames": 8},
                          "min_num_frames <= max_num_frames.*"
                          + _where("vlm_sft", "frame_sampler_args")),
  "zero_frames": (f"{VLM}.frame_sampler_args", {"max_num_frames": 0, "min_num_frames": 0},
                  _where("vlm_sft", "frame_sampler_args")),
  "unknown_sample_mode": (f"{VLM}.frame_sampler_args", {"sample": "uniform"},
                          "'rand', 'middle' or 'fpsX'.*got 'uniform'.*"
                          + _where("vlm_sft", "frame_sampler_args.sample")),
  "fps_zero": (f"{VLM}.frame_sampler_args", {"sample": "fps0"},
               _where("vlm_sft", "frame_sampler_args.sample")),
  "unknown_frame_key": (f"{VLM}.frame_sampler_args", {"fps": 2},
                        _where("vlm_sft", "fps")),
  # A family's own option (VLM's frame sampler) on a group of another family: refused, not
  # ignored (a T2I row has no video to sample).
  "frames_on_t2i": (f"{T2I}.frame_sampler_args", {"max_num_frames": 4, "min_num_frames": 2},
                    "`frame_sampler_args` is an option of vlm_sft groups only.*"
                    + _where("t2i_pretrain", "frame_sampler_args")),
  "frames_on_edit": (f"{EDIT}.frame_sampler_args", {}, "option of vlm_sft groups only.*"
                     + _where("unified_edit", "frame_sampler_args")),
  "video_bytes_zero": ("max_video_bytes", 0, _where(None, "max_video_bytes")),
  "video_frames_zero": ("max_video_frames", 0, _where(None, "max_video_frames")),
  "per_sample_over_max": ("max_num_tokens_per_sample", 40000,
                          "exceeds max_num_tokens 36864.*"
                          + _where(None, "max_num_tokens_per_sample")),
  "num_used_data_length": (f"{T2I}.num_used_data", [1, 2],
                           _where("t2i_pretrain", "num_used_data")),
  "unknown_dataset_name": (f"{T2I}.dataset_names", ["demo_t2i", "laion"],
                           "'laion' is not in `dataset_info`.*" + _where("t2i_pretrain", "laion")),
  # Ranges: every numeric field is checked when the file loads, not when it is first used.
  "expected_tokens_zero": ("expected_num_tokens", 0,
                           "must be >= 1, got 0.*" + _where(None, "expected_num_tokens")),
  "expected_tokens_negative": ("expected_num_tokens", -5, _where(None, "expected_num_tokens")),
  "per_sample_negative": ("max_num_tokens_per_sample", -1,
                          _where(None, "max_num_tokens_per_sample")),
  "buffer_size_negative": ("max_buffer_size", -1,
                           "must be >= 0.*" + _where(None, "max_buffer_size")),
  "prefer_buffer_negative": ("prefer_buffer_before", -100, _where(None, "prefer_buffer_before")),
  "dropout_over_one": ("text_cond_dropout_prob", 5,
                       "between 0 and 1, got 5.0.*" + _where(None, "text_cond_dropout_prob")),
  "workers_negative": ("num_workers", -1, _where(None, "num_workers")),
  "bad_ratio_negative": ("max_bad_ratio", -1, _where(None, "max_bad_ratio")),
  "epochs_negative": ("num_epochs", -2, _where(None, "num_epochs")),
  "epochs_zero": ("num_epochs", 0, _where(None, "num_epochs")),
  "seed_negative": ("data_seed", -1, _where(None, "data_seed")),
  "timeout_zero": ("element_timeout_s", 0, _where(None, "element_timeout_s")),
  "timeout_nan": ("element_timeout_s", float("nan"), _where(None, "element_timeout_s")),
  "image_bytes_zero": ("max_image_bytes", 0, _where(None, "max_image_bytes")),
  "drops_zero": ("max_consecutive_drops", 0, _where(None, "max_consecutive_drops")),
  "nemo_key_out_of_range": ("dataset", {"max_buffer_size": -1},
                            _where(None, "dataset.max_buffer_size")),
  "shuffle_seed_negative": (f"{VLM}.shuffle_seed", -1, _where("vlm_sft", "shuffle_seed")),
  "num_used_data_negative": (f"{T2I}.num_used_data", [-3], _where("t2i_pretrain", "num_used_data")),
  "num_used_data_zero": (f"{VLM}.num_used_data", [0], _where("vlm_sft", "num_used_data")),
  "min_over_max_image_size": (f"{T2I}.image_transform_args.min_image_size", 600,
                              "min_image_size 600 exceeds max_image_size 512.*"
                              + _where("t2i_pretrain", "image_transform_args")),
  "stride_zero": (f"{EDIT}.vit_image_transform_args.image_stride", 0,
                  _where("unified_edit", "vit_image_transform_args.image_stride")),
  "data_dir_is_a_file": ("dataset_info.vlm_sft.demo_vlm.data_dir", "vlm/sft.jsonl",
                         "is a file; `data_dir` must name a folder.*"
                         + _where("vlm_sft", "demo_vlm.data_dir")),
  "jsonl_path_is_a_folder": ("dataset_info.vlm_sft.demo_vlm.jsonl_path", "vlm",
                             "is a folder; `jsonl_path` must name a file.*"
                             + _where("vlm_sft", "demo_vlm.jsonl_path")),
}


@pytest.mark.parametrize("dotted,value,match", ERRORS.values(), ids=ERRORS.keys())
def test_config_errors_name_the_key_and_group(root, dotted, value, match):
  raw = minimal()
  _set(raw, dotted, value)
  with pytest.raises(ConfigError, match=match):
    config_from_dict(raw, file="main.yaml", base_dir=str(root))


def test_range_errors_name_the_file(root):
  raw = minimal()
  raw["num_workers"] = -1
  with pytest.raises(ConfigError, match=re.escape("(file 'main.yaml', key 'num_workers')")):
    config_from_dict(raw, file="main.yaml", base_dir=str(root))


def test_overrides_are_range_checked_too(tmp_path, demo_dir):
  (tmp_path / "configs").mkdir()
  shutil.copy(CONFIGS / "example.yaml", tmp_path / "configs" / "example.yaml")
  (tmp_path / ".demo_data").symlink_to(demo_dir, target_is_directory=True)
  with pytest.raises(ConfigError, match=_where(None, "num_epochs")):
    load_config(tmp_path / "configs" / "example.yaml", num_epochs=0)


def test_geometry_limits_are_inclusive(root):
  raw = minimal()
  _set(raw, f"{VLM}.image_transform_args.max_image_size", 980)  # exactly 70 patches
  _set(raw, f"{T2I}.image_transform_args.max_image_size", 1024)
  _set(raw, "max_latent_size", 64)  # exactly 64 latents
  cfg = config_from_dict(raw, file="main.yaml", base_dir=str(root))
  assert cfg.vae_image_size == 1024


# --- sections in their own files, NeMo's `dataset:` nesting -----------------------------


def _write_yaml(path, value):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(yaml.safe_dump(value))


def test_sections_in_separate_files_resolve_relative_to_those_files(tmp_path):
  raw = minimal()
  info = raw["dataset_info"]
  info["t2i_pretrain"]["demo_t2i"]["data_dir"] = "data/t2i"
  info["unified_edit"]["demo_edit"]["data_dir"] = "data/edit"
  info["vlm_sft"]["demo_vlm"] = {"data_dir": "data/vlm", "jsonl_path": "data/vlm/sft.jsonl"}
  for folder in ("t2i", "edit", "vlm"):
    (tmp_path / "info" / "data" / folder).mkdir(parents=True)
  (tmp_path / "info" / "data" / "vlm" / "sft.jsonl").write_text("")
  _write_yaml(tmp_path / "info" / "dataset_info.yaml", info)
  _write_yaml(tmp_path / "groups" / "mixture.yaml", raw["grouped_datasets"])
  _write_yaml(tmp_path / "main.yaml", {"dataset_info": "info/dataset_info.yaml",
                                       "grouped_datasets": "groups/mixture.yaml"})
  cfg = load_config(tmp_path / "main.yaml")
  assert Path(cfg.group("t2i_pretrain").datasets[0].data_dir) == tmp_path / "info/data/t2i"
  assert Path(cfg.group("vlm_sft").datasets[0].jsonl_path) == (
    tmp_path / "info/data/vlm/sft.jsonl")
  # An error inside the groups file names that file.
  raw["grouped_datasets"]["t2i_pretrain"]["weight"] = "heavy"
  _write_yaml(tmp_path / "groups" / "mixture.yaml", raw["grouped_datasets"])
  with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "groups" / "mixture.yaml"))):
    load_config(tmp_path / "main.yaml")


def test_nemo_dataset_section_is_accepted(root):
  raw = minimal()
  raw["dataset"] = {"_target_": "nemo_automodel.components.datasets.multimodal.build",
                    "max_num_tokens": 20480, "expected_num_tokens": 16384,
                    "max_num_tokens_per_sample": 8192, "data_seed": 7,
                    "vae_cond_dropout_prob": 0.5, "interpolate_pos": True}
  cfg = config_from_dict(raw, file="main.yaml", base_dir=str(root))
  assert (cfg.max_num_tokens, cfg.expected_num_tokens, cfg.max_num_tokens_per_sample) == (
    20480, 16384, 8192)
  assert (cfg.data_seed, cfg.vae_cond_dropout_prob, cfg.interpolate_pos) == (7, 0.5, True)


def test_nemo_key_given_twice_is_an_error(root):
  raw = minimal()
  raw["max_num_tokens"] = 20480
  raw["dataset"] = {"max_num_tokens": 30000}
  with pytest.raises(ConfigError, match="given twice.*" + _where(None, "dataset.max_num_tokens")):
    config_from_dict(raw, file="main.yaml", base_dir=str(root))


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1])
def test_weight_must_be_finite_and_non_negative(demo_dir, weight):
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  raw["grouped_datasets"]["vlm_sft"]["weight"] = weight
  with pytest.raises(ConfigError, match=r"finite.*group 'vlm_sft', key 'weight'"):
    config_from_dict(raw, file="w.yaml", base_dir=str(CONFIGS))


# --- groups without records (found when the sources are opened) -------------------------


def _demo_copy(demo_dir, tmp_path):
  shutil.copytree(demo_dir, tmp_path / "demo")
  return tmp_path / "demo"


def test_empty_jsonl_names_the_group_and_file(demo_dir, demo_tokenizer, tmp_path):
  demo = _demo_copy(demo_dir, tmp_path)
  (demo / "vlm" / "sft.jsonl").write_text("")
  with pytest.raises(DatasetError, match=r"group 'vlm_sft' has no records \(dataset 'demo_vlm' "
                     r".*sft\.jsonl\) has 0\).*file '.*sft\.jsonl'"):
    build_pipeline(load_shipped("demo", demo), demo_tokenizer)


def test_empty_parquet_names_the_group_and_folder(demo_dir, demo_tokenizer, tmp_path):
  demo = _demo_copy(demo_dir, tmp_path)
  for path in (demo / "t2i").glob("*.parquet"):
    pq.write_table(pq.read_table(path).slice(0, 0), path)
  with pytest.raises(DatasetError, match=r"group 't2i_pretrain' has no records.*has 0"):
    build_pipeline(load_shipped("demo", demo), demo_tokenizer)


def test_fewer_records_than_processes_names_the_group(demo_config, demo_tokenizer):
  with pytest.raises(DatasetError, match=r"group 't2i_pretrain' has 76 records, fewer than the "
                     r"100 logical shards that share it \(one per process.*'demo_t2i'.*has 76"):
    build_pipeline(demo_config, demo_tokenizer, process_index=0, process_count=100)


def test_weights_whose_sum_overflows_are_refused_naming_them(demo_dir):
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  for group in raw["grouped_datasets"].values():
    group["weight"] = 1e308  # each finite; their sum is not
  with pytest.raises(ConfigError, match=r"weights \(t2i_pretrain: 1e\+308, unified_edit: "
                     r"1e\+308, vlm_sft: 1e\+308\) add up to more than a float holds"):
    config_from_dict(raw, file="w.yaml", base_dir=str(CONFIGS))
  for group in raw["grouped_datasets"].values():
    group["weight"] = 5e307  # the largest that still add up: loads as before
  cfg = config_from_dict(raw, file="w.yaml", base_dir=str(CONFIGS))
  assert [g.weight for g in cfg.groups] == [5e307] * 3


@pytest.mark.parametrize("key", ["tokenizer_path", "parquet_info_path", "jsonl_path"])
def test_a_fifo_where_the_config_names_a_file_is_refused_unopened(demo_dir, tmp_path, key):
  from fifos import fifo  # pylint: disable=import-outside-toplevel
  raw = yaml.safe_load(shipped_path("demo").read_text())
  info = yaml.safe_load((demo_dir / "dataset_info.yaml").read_text())
  raw["dataset_info"], raw["tokenizer_path"] = info, str(demo_dir / "tokenizer")
  for group in info.values():
    for entry in group.values():
      entry["data_dir"] = str(demo_dir / entry["data_dir"])
      for k in ("jsonl_path", "parquet_info_path"):
        if k in entry:
          entry[k] = str(demo_dir / entry[k])
  target = tmp_path / "fifo"
  if key == "tokenizer_path":
    raw[key] = str(target)
  else:
    group = "vlm_sft" if key == "jsonl_path" else "unified_edit"
    next(iter(info[group].values()))[key] = str(target)
  with fifo(target) as rescued:
    with pytest.raises(ConfigError, match=re.escape(f"{target} is a special file")):
      config_from_dict(raw, file="f.yaml", base_dir=str(tmp_path))
  assert not rescued


TYPOS = {
  "top_level": ("num_epoch", 1, "num_epochs", None),
  "top_level_section": ("grouped_dataset", {}, "grouped_datasets", None),
  "group": (f"{T2I}.wieght", 1.0, "weight", "t2i_pretrain"),
  "family_option": (f"{VLM}.shuffle_line", True, "shuffle_lines", "vlm_sft"),
  "family": ("grouped_datasets.t2i_pretrian", {"dataset_names": ["x"]}, "t2i_pretrain",
             "t2i_pretrian"),
  "dataset_info": ("dataset_info.t2i_pretrain.demo_t2i.num_totl_samples", 4, "num_total_samples",
                   "t2i_pretrain"),
  "transform": (f"{T2I}.image_transform_args.max_image_sise", 512, "max_image_size",
                "t2i_pretrain"),
}


@pytest.mark.parametrize("dotted,value,meant,group", TYPOS.values(), ids=TYPOS.keys())
def test_a_misspelled_key_is_answered_with_the_key_meant(root, dotted, value, meant, group):
  raw = minimal()
  _set(raw, dotted, value)
  with pytest.raises(ConfigError, match=re.escape(f"did you mean `{meant}`?")) as e:
    config_from_dict(raw, file="main.yaml", base_dir=str(root))
  assert e.value.group == group
  assert "allowed" not in str(e.value)  # one suggestion, not a list of every key


def test_an_unknown_key_far_from_every_key_lists_the_allowed_ones(root):
  raw = minimal()
  raw["grouped_datasets"]["t2i_pretrain"]["colour"] = "red"
  with pytest.raises(ConfigError, match="allowed: ") as e:
    config_from_dict(raw, file="main.yaml", base_dir=str(root))
  assert "did you mean" not in str(e.value)


def test_example_yaml_marks_upstreams_num_used_data_as_not_to_copy():
  lines = (CONFIGS / "example.yaml").read_text().splitlines()
  used = [line for line in lines if line.strip().startswith("num_used_data:")]
  assert len(used) == 3 and all("leave it out in your own config" in line for line in used)
  assert any("How much of a dataset is read" in line for line in lines if line.startswith("#"))
