"""BAGEL/NeMo YAML configuration loaded into frozen dataclasses, validated at build time.

An upstream user's YAML loads unchanged: `grouped_datasets` and `dataset_info`
(inline or as paths to their own YAML files), plus NeMo's top-level packing fields
(optionally nested under `dataset:`). A NeMo recipe file loads too: see `recipe`.
Paths resolve relative to the file naming them. Every error names the file, the group
and the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from bagel_grain import fs, recipe
from bagel_grain.config_values import check_keys, check_range, key_name, number
from bagel_grain.config_yaml import load_yaml_file, shown
from bagel_grain.errors import ConfigError
from bagel_grain.families.family import Family, GroupOptions
from bagel_grain.families.registry import FAMILIES
from bagel_grain.families.video import DEFAULT_MAX_VIDEO_BYTES, DEFAULT_MAX_VIDEO_FRAMES
from bagel_grain.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_PIXELS, ImageTransform
from bagel_grain.sources.parquet import DEFAULT_CACHE_BYTES


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """One entry of `dataset_info`, paths already resolved.

  `array_record_path` (a file or a folder of `*.array_record` files written by
  `bagel_grain.tooling.convert`) replaces the parquet files or the JSONL file. Such a
  dataset holds exactly the records the group reads: `num_used_data` and
  `shuffle_lines` were applied when it was converted and are not applied again.
  """

  name: str
  data_dir: str
  jsonl_path: str | None = None
  parquet_info_path: str | None = None
  num_used_data: int | None = None
  array_record_path: str | None = None
  # Converted data only: the records `dataset_info` says its files hold (checked on read).
  num_records: int | None = None


@dataclasses.dataclass(frozen=True)
class GroupConfig:
  """One entry of `grouped_datasets`; its name is its family's (see `families.registry`)."""

  name: str
  datasets: tuple[DatasetSpec, ...]
  options: GroupOptions  # the family's own keys, parsed: an instance of `family.options`
  weight: float = 1.0
  is_mandatory: bool = False
  image_transform: ImageTransform | None = None
  vit_image_transform: ImageTransform | None = None
  shuffle_lines: bool = False
  shuffle_seed: int = 0

  @property
  def family(self) -> Family:
    return FAMILIES[self.name]

  def role_transform(self, role: str) -> ImageTransform | None:
    """The image transform of `role` ("vae" or "vit"); None when the family has no such role."""
    field = self.family.image_roles.get(role)
    return None if field is None else getattr(self, field)

  @property
  def vae_transform(self) -> ImageTransform | None:
    return self.role_transform("vae")

  @property
  def vit_transform(self) -> ImageTransform | None:
    return self.role_transform("vit")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Everything that shapes the packed stream, plus the knobs that do not."""

  groups: tuple[GroupConfig, ...]
  tokenizer_path: str | None = None
  # Upstream packing fields (NeMo's `dataset:` section), upstream defaults.
  expected_num_tokens: int = 32768
  max_num_tokens: int = 36864
  max_num_tokens_per_sample: int = 16384
  prefer_buffer_before: int = 16384
  max_buffer_size: int = 50
  vit_patch_size: int = 14
  max_num_patch_per_side: int = 70
  interpolate_pos: bool = False
  data_seed: int = 42
  text_cond_dropout_prob: float = 0.1
  vit_cond_dropout_prob: float = 0.3
  vae_cond_dropout_prob: float = 0.3
  vae_image_downsample: int = 16
  max_latent_size: int = 32
  # New fields: row capacities (None = derived, see packing.row.default_capacities).
  vit_patch_capacity: int | None = None
  vae_token_capacity: int | None = None
  vae_image_capacity: int | None = None
  split_capacity: int | None = None
  num_workers: int = 0
  num_epochs: int | None = None
  # Defaults a NeMo recipe sets (`bagel_grain.recipe`); none of them changes the rows.
  batch_size: int = 1  # rows per batch of one process: `build_pipeline`'s default
  use_flex: bool = False  # the `use_flex` to pass to `packing.to_bagel_dict`
  # NeMo's global seed: when set, it seeds the group draws, dropout and timesteps,
  # and `data_seed` only orders the records, as in NeMo (see `pipeline.stream_seeds`).
  seed: int | None = None
  # Logical shards the stream is defined over (None = one per JAX process, docs/elastic.md).
  logical_shards: int | None = None
  # Bad-input limits (README: bad input). None of them changes which good records are packed.
  max_decode_pixels: int = 89_478_485  # Pillow's own default limit
  max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # a larger image file is never read
  max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES  # a larger video file is never opened
  max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES  # frames sampled or decoded per video sample
  max_row_group_cache_bytes: int = DEFAULT_CACHE_BYTES  # decoded row groups, per parquet dataset
  element_timeout_s: float = 300.0  # one element at most, then the stream stops
  # Transient storage failures are retried this long per element, then next() raises
  # StorageUnavailableError (retriable); below element_timeout_s (bagel_grain/storage.py).
  storage_timeout_s: float = 120.0
  # Opt-in fast path, off by default: changes pixels slightly (README: fast paths).
  jpeg_draft: bool = False
  allow_truncated_images: bool = False
  max_consecutive_drops: int = 1000
  bad_record_window: int = 200  # a group whose last N records are mostly bad stops the run
  max_bad_ratio: float = 0.9

  @property
  def vae_image_size(self) -> int:
    """S: the largest VAE max_image_size, rounded up to the VAE stride."""
    sizes = [g.vae_transform.max_image_size for g in self.groups if g.vae_transform]
    if not sizes:
      return 0
    d = self.vae_image_downsample
    return -(-max(sizes) // d) * d

  def group(self, name: str) -> GroupConfig:
    for g in self.groups:
      if g.name == name:
        return g
    raise KeyError(name)


_PACKING_FIELDS = {f.name for f in dataclasses.fields(PipelineConfig)} - {"groups"}
# Fields that never change a row of the stream: how fast or with how many processes it is
# made, when a run stops for bad data, resource limits, what the batches are wrapped in.
# A saved state restores under any value of them (see `pipeline.fingerprint`).
STREAM_NEUTRAL_FIELDS = frozenset({
    "tokenizer_path", "num_workers", "batch_size", "use_flex", "max_consecutive_drops",
    "bad_record_window", "max_bad_ratio", "max_image_bytes", "max_row_group_cache_bytes",
    "element_timeout_s", "storage_timeout_s", "max_video_bytes", "max_video_frames"})
# The allowed range of each numeric top-level field, bounds included (None: unbounded).
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "expected_num_tokens": (1, None), "max_num_tokens": (1, None),
    "max_num_tokens_per_sample": (1, None), "prefer_buffer_before": (0, None),
    "max_buffer_size": (0, None), "vit_patch_size": (1, None),
    "max_num_patch_per_side": (1, None), "data_seed": (0, None), "seed": (0, None),
    "text_cond_dropout_prob": (0, 1), "vit_cond_dropout_prob": (0, 1),
    "vae_cond_dropout_prob": (0, 1), "vae_image_downsample": (1, None),
    "max_latent_size": (1, None), "vit_patch_capacity": (1, None),
    "vae_token_capacity": (1, None), "vae_image_capacity": (1, None),
    "split_capacity": (1, None), "num_workers": (0, None), "num_epochs": (1, None),
    "batch_size": (1, None), "logical_shards": (1, None), "max_decode_pixels": (1, None),
    "max_image_bytes": (1, None), "max_video_bytes": (1, None), "max_video_frames": (1, None),
    "max_row_group_cache_bytes": (0, None), "max_consecutive_drops": (1, None),
    "bad_record_window": (1, None), "max_bad_ratio": (0, 1), "element_timeout_s": (0.001, None),
    "storage_timeout_s": (0.001, None),
}
_PATH_KINDS = {"data_dir": ("folder",), "jsonl_path": ("file",), "parquet_info_path": ("file",),
               "array_record_path": ("file", "folder")}
# The keys every group takes; a family adds its own (`Family.options`).
_GROUP_KEYS = {"dataset_names", "weight", "is_mandatory", "num_used_data",
               "image_transform_args", "vit_image_transform_args", "shuffle_lines",
               "shuffle_seed", "resume_data_status"}
_INFO_KEYS = {"data_dir", "jsonl_path", "parquet_info_path", "array_record_path", "num_files",
              "num_total_samples"}
_TRANSFORM_KEYS = {"image_stride", "max_image_size", "min_image_size", "max_pixels"}


def _section(value: Any, base_dir: str, file: str, key: str) -> tuple[Mapping, str, str]:
  """An inline mapping, or a path to a YAML file holding it (then paths resolve there)."""
  if isinstance(value, str):
    path = fs.resolve(value, base_dir)
    value = load_yaml_file(path, what=f"`{key}` file")
    file, base_dir = path, fs.dirname(path)
  if not isinstance(value, Mapping):
    raise ConfigError(f"`{key}` must be a mapping or a path to one", file=file, key=key)
  return value, base_dir, file


def _transform(raw: Any, *, file: str, group: str, key: str) -> ImageTransform:
  if not isinstance(raw, Mapping):
    raise ConfigError("must be a mapping", file=file, group=group, key=key)
  check_keys(raw, _TRANSFORM_KEYS, file=file, group=group, where=key)
  for required in ("image_stride", "max_image_size", "min_image_size"):
    if required not in raw:
      raise ConfigError(f"missing `{required}`", file=file, group=group, key=key)
  values = {k: number(v, int, file=file, group=group, key=f"{key}.{k}")
            for k, v in raw.items()}
  for k, v in values.items():
    check_range(v, 1, None, file=file, group=group, key=f"{key}.{k}")
  if values["min_image_size"] > values["max_image_size"]:
    raise ConfigError(f"min_image_size {values['min_image_size']} exceeds max_image_size "
                      f"{values['max_image_size']}", file=file, group=group, key=key)
  values.setdefault("max_pixels", DEFAULT_MAX_PIXELS)
  return ImageTransform(**values)


def _datasets(family: Family, raw: Mapping, info: Mapping, info_dir: str, info_file: str,
              file: str) -> tuple[DatasetSpec, ...]:
  group = family.name
  names = raw.get("dataset_names")
  if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
    raise ConfigError("`dataset_names` must be a non-empty list of names",
                      file=file, group=group, key="dataset_names")
  used = raw.get("num_used_data")
  if used is None:
    used = [None] * len(names)
  if not isinstance(used, list) or len(used) != len(names):
    raise ConfigError("`num_used_data` needs one entry per dataset name",
                      file=file, group=group, key="num_used_data")
  group_info = info.get(group)
  if not isinstance(group_info, Mapping):
    raise ConfigError("no entry for this group in `dataset_info`", file=info_file,
                      group=group, key=group)
  specs = []
  for name, n in zip(names, used):
    entry = group_info.get(name)
    if not isinstance(entry, Mapping):
      raise ConfigError(f"dataset {shown(name)} is not in `dataset_info`", file=info_file,
                        group=group, key=name)
    check_keys(entry, _INFO_KEYS, file=info_file, group=group, where=f"dataset_info.{name}")
    paths = {}
    for key in ("data_dir", "jsonl_path", "parquet_info_path", "array_record_path"):
      if key not in entry:
        continue
      path = fs.resolve(entry[key], info_dir)
      kind = fs.kind(path)
      if kind == "missing":
        raise ConfigError(f"path does not exist: {path}", file=info_file, group=group,
                          key=f"{name}.{key}")
      if kind not in _PATH_KINDS[key]:
        raise ConfigError(f"{path} is a {kind}; `{key}` must name a "
                          f"{' or a '.join(_PATH_KINDS[key])}", file=info_file, group=group,
                          key=f"{name}.{key}")
      paths[key] = path
    if "data_dir" not in paths and "array_record_path" in paths:
      ar = paths["array_record_path"]  # converted records need no data_dir of their own
      paths["data_dir"] = ar if fs.is_dir(ar) else os.path.dirname(ar)
    if "data_dir" not in paths:
      raise ConfigError("missing `data_dir`", file=info_file, group=group, key=name)
    if family.reads_jsonl and not paths.keys() & {"jsonl_path", "array_record_path"}:
      raise ConfigError("this family's datasets need `jsonl_path` (or `array_record_path`)",
                        file=info_file, group=group, key=f"{name}.jsonl_path")
    if n is not None:
      n = number(n, int, file=file, group=group, key="num_used_data")
      check_range(n, 1, None, file=file, group=group, key="num_used_data")
    if "array_record_path" in paths and "num_total_samples" in entry:
      paths["num_records"] = number(entry["num_total_samples"], int, file=info_file,
                                    group=group, key=f"{name}.num_total_samples")
    specs.append(DatasetSpec(name=name, num_used_data=n, **paths))
  return tuple(specs)


def _check_group_keys(family: Family, raw: Mapping, file: str) -> None:
  """The keys every group takes and the family's own options; another family's option is
  refused as such, naming its family."""
  allowed = _GROUP_KEYS | family.options.KEYS
  for key in raw:
    owners = [f.name for f in FAMILIES.values() if key in f.options.KEYS]
    if key not in allowed and owners:
      raise ConfigError(f"`{key}` is an option of {' and '.join(owners)} groups only, not of "
                        f"{family.name}", file=file, group=family.name, key=key)
  check_keys(raw, allowed, file=file, group=family.name, where="grouped_datasets")


def _group(name: str, raw: Any, info: Mapping, info_dir: str, info_file: str,
           file: str) -> GroupConfig:
  family = FAMILIES.get(name)
  if family is None:
    raise ConfigError(f"unknown dataset family; known: {list(FAMILIES)}", file=file,
                      group=key_name(name), key=key_name(name))
  if not isinstance(raw, Mapping):
    raise ConfigError("a group must be a mapping", file=file, group=name, key=name)
  _check_group_keys(family, raw, file)
  kwargs: dict[str, Any] = {"name": name}
  kwargs["datasets"] = _datasets(family, raw, info, info_dir, info_file, file)
  if "weight" in raw:
    kwargs["weight"] = number(raw["weight"], float, file=file, group=name, key="weight")
    if not 0 <= kwargs["weight"] < float("inf"):  # also refuses nan
      raise ConfigError("`weight` must be a finite number >= 0", file=file, group=name,
                        key="weight")
  for key in ("is_mandatory", "shuffle_lines"):
    if key in raw:
      if not isinstance(raw[key], bool):
        raise ConfigError(f"`{key}` must be true or false", file=file, group=name, key=key)
      kwargs[key] = raw[key]
  if "shuffle_seed" in raw:
    kwargs["shuffle_seed"] = number(raw["shuffle_seed"], int, file=file, group=name,
                                    key="shuffle_seed")
    check_range(kwargs["shuffle_seed"], 0, None, file=file, group=name, key="shuffle_seed")
  for key, field in (("image_transform_args", "image_transform"),
                     ("vit_image_transform_args", "vit_image_transform")):
    if key in raw:
      kwargs[field] = _transform(raw[key], file=file, group=name, key=key)
  kwargs["options"] = family.options.parse(raw, file=file, group=name)
  for field in family.image_roles.values():
    if field not in kwargs:
      raise ConfigError(f"this family needs `{field}_args`", file=file, group=name,
                        key=f"{field}_args")
  return GroupConfig(**kwargs)


def _check_transform(t: ImageTransform, *, kind: str, stride: tuple[str, int],
                     limit: tuple[str, int], file: str, group: str, key: str) -> None:
  """A transform's stride must be its role's (VAE or ViT) and its largest image must fit."""
  (stride_field, stride_value), (limit_field, limit_value) = stride, limit
  if t.image_stride != stride_value:
    raise ConfigError(f"{kind} transform stride {t.image_stride} must equal {stride_field} "
                      f"{stride_value}", file=file, group=group, key=f"{key}.image_stride")
  if t.max_image_size / stride_value > limit_value:
    raise ConfigError(
        f"{kind} max_image_size {t.max_image_size} / {stride_field} {stride_value} exceeds "
        f"{limit_field} {limit_value}", file=file, group=group, key=f"{key}.max_image_size")


def _check_ranges(cfg: PipelineConfig, file: str, written: Mapping[str, str]) -> None:
  """Each numeric top-level field in its range; `written` names keys as the file wrote them."""
  for key, (least, greatest) in _RANGES.items():
    value = getattr(cfg, key)
    if value is not None:
      check_range(value, least, greatest, file=file, group=None, key=written.get(key, key))


def _check_geometry(cfg: PipelineConfig, file: str) -> None:
  for g in cfg.groups:
    roles = g.family.image_roles
    if g.vae_transform is not None:
      _check_transform(g.vae_transform, kind="VAE",
                       stride=("vae_image_downsample", cfg.vae_image_downsample),
                       limit=("max_latent_size", cfg.max_latent_size), file=file,
                       group=g.name, key=f"{roles['vae']}_args")
    if g.vit_transform is not None:
      _check_transform(g.vit_transform, kind="ViT",
                       stride=("vit_patch_size", cfg.vit_patch_size),
                       limit=("max_num_patch_per_side", cfg.max_num_patch_per_side),
                       file=file, group=g.name, key=f"{roles['vit']}_args")
  if cfg.max_num_tokens_per_sample > cfg.max_num_tokens:
    raise ConfigError(
        f"max_num_tokens_per_sample {cfg.max_num_tokens_per_sample} exceeds max_num_tokens "
        f"{cfg.max_num_tokens}", file=file, key="max_num_tokens_per_sample")
  if cfg.expected_num_tokens > cfg.max_num_tokens:
    raise ConfigError(f"expected_num_tokens {cfg.expected_num_tokens} exceeds max_num_tokens "
                      f"{cfg.max_num_tokens}", file=file, key="expected_num_tokens")
  if not any(g.weight > 0 for g in cfg.groups):
    raise ConfigError("at least one group needs a positive `weight`", file=file,
                      key="weight")
  # The mixer divides by the weights' sum: an overflow there would make every share nan.
  if not math.isfinite(sum(g.weight for g in cfg.groups)):
    weights = ", ".join(f"{g.name}: {g.weight!r}" for g in cfg.groups)
    raise ConfigError(f"the groups' weights ({weights}) add up to more than a float holds; "
                      "only their ratios matter: scale them down", file=file, key="weight")
  if cfg.logical_shards is not None and cfg.logical_shards < 1:
    raise ConfigError(f"`logical_shards` must be >= 1 (or unset), got {cfg.logical_shards}",
                      file=file, key="logical_shards")


def _top_level(raw: Mapping, file: str, base_dir: str,
               written: Mapping[str, str]) -> dict[str, Any]:
  """The top-level fields; `written` maps a field to the key the file wrote it under."""
  kwargs: dict[str, Any] = {}
  types = {f.name: f.type for f in dataclasses.fields(PipelineConfig)}
  for key, value in raw.items():
    if key not in _PACKING_FIELDS:
      raise ConfigError(
          "unknown top-level key; expected `grouped_datasets`, `dataset_info`, a NeMo "
          f"recipe section or one of {sorted(_PACKING_FIELDS)}", file=file, key=key_name(key))
    kind, name = types[key], written.get(key, key)
    if value is None and "None" in kind:
      kwargs[key] = None
    elif key == "tokenizer_path":
      from bagel_grain.tokenizer_path import resolve_tokenizer_path  # pylint: disable=import-outside-toplevel
      kwargs[key] = resolve_tokenizer_path(str(value), base_dir, file=file, key=name)
    elif kind.startswith("bool"):
      if not isinstance(value, bool):
        raise ConfigError(f"`{name}` must be true or false", file=file, key=name)
      kwargs[key] = value
    elif kind.startswith("float"):
      kwargs[key] = number(value, float, file=file, group=None, key=name)
    else:
      kwargs[key] = number(value, int, file=file, group=None, key=name)
  return kwargs


def config_from_dict(raw: Mapping, *, file: str = "<dict>", base_dir: str = ".") -> PipelineConfig:
  """Builds and validates a config from a parsed YAML mapping."""
  if not isinstance(raw, Mapping):
    raise ConfigError("the config must be a mapping", file=file)
  raw, written = recipe.flatten(raw, file=file,
                                fields=_PACKING_FIELDS | {"grouped_datasets", "dataset_info"})
  if "grouped_datasets" not in raw and raw and all(k in FAMILIES for k in raw):
    raise ConfigError("this file holds only `grouped_datasets`; write a config with "
                      "`grouped_datasets: <this file>` and `dataset_info`", file=file)
  for key in ("grouped_datasets", "dataset_info"):
    if key not in raw:
      raise ConfigError(f"missing `{key}`", file=file, key=key)
  groups_raw, _, groups_file = _section(raw.pop("grouped_datasets"), base_dir, file,
                                        "grouped_datasets")
  info, info_dir, info_file = _section(raw.pop("dataset_info"), base_dir, file, "dataset_info")
  if not groups_raw:
    raise ConfigError("`grouped_datasets` is empty", file=groups_file, key="grouped_datasets")
  groups = tuple(_group(name, g, info, info_dir, info_file, groups_file)
                 for name, g in groups_raw.items())
  kwargs = _top_level(raw, file, base_dir, written)
  cfg = PipelineConfig(groups=groups, **kwargs)
  _check_ranges(cfg, file, written)
  _check_geometry(cfg, groups_file)
  return cfg


def load_config(path: str | os.PathLike, **overrides: Any) -> PipelineConfig:
  """Loads a YAML config; keyword overrides replace top-level fields after validation."""
  path = str(path)
  raw = load_yaml_file(path)
  cfg = config_from_dict(raw, file=path, base_dir=fs.dirname(path))
  if overrides:
    cfg = dataclasses.replace(cfg, **overrides)
    _check_ranges(cfg, path, {})
    _check_geometry(cfg, path)
  return cfg
