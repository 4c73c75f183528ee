"""A family: all that differs between dataset kinds, in one record looked up by group name."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from bagel_grain.drops import DropReason
from bagel_grain.errors import DatasetError
from bagel_grain.families.base import FamilyTransform
from bagel_grain.sources.array_record import ArrayRecordSource, array_record_files
from bagel_grain.sources.base import RecordSource
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import DEFAULT_CACHE_BYTES
from bagel_grain.sources.parquet import dataset_source as parquet_dataset

if TYPE_CHECKING:
  from bagel_grain.config import DatasetSpec, GroupConfig


class RecordFormat(enum.StrEnum):
  """How a dataset's records are stored."""

  PARQUET = "parquet"  # rows of a folder of parquet files
  JSONL = "jsonl"  # lines of a JSONL file, their files beside it
  ARRAY_RECORD = "array_record"  # records `bagel-grain convert` framed, of any family


@dataclasses.dataclass(frozen=True)
class GroupOptions:
  """The group keys a family reads beyond those every group has, parsed: none here.

  A family with options of its own subclasses it: its fields with their defaults,
  `KEYS` (the YAML keys it reads) and `parse`; `fingerprint` when its entries must
  hash as an earlier version hashed them. A group of another family that sets one
  of those keys is refused when the config loads.
  """

  KEYS: ClassVar[frozenset[str]] = frozenset()

  @classmethod
  def parse(cls, raw: Mapping[str, Any], *, file: str, group: str) -> GroupOptions:
    """The options of a group's mapping `raw` (its keys checked already), else `ConfigError`
    naming `file`, `group` and the key."""
    del raw, file, group
    return cls()

  def fingerprint(self) -> dict[str, Any]:
    """The options as the group's stream fingerprint hashes them, beside its other fields:
    every field, so that a restore under other options is refused.

    Before families declared their options, every group held upstream's default
    frame sampler and hashed it (`sample` left out): a family without that option
    hashes the entry still, so the states saved then restore.
    """
    return {"frame_sampler": {"max_num_frames": 12, "min_num_frames": 8},
            **dataclasses.asdict(self)}


def _no_transform_args(group: GroupConfig) -> dict[str, Any]:
  del group
  return {}


@dataclasses.dataclass(frozen=True, eq=False)  # one object per family: compared by identity
class Family:
  """What a `grouped_datasets` key means: how its records are read, parsed and converted.

  - `name`: the key (upstream's family name).
  - `transform`: the `FamilyTransform` class, built with one `<role>_transform` per
    image role, `transform_args(group)` and the pipeline's common arguments.
  - `image_roles`: role (`"vae"`, `"vit"`) -> the `GroupConfig` field holding its
    `ImageTransform`; config validation requires each as `<field>_args`.
  - `options`: the `GroupOptions` subclass of the family's own group keys, parsed
    into `GroupConfig.options`.
  - `columns`: the parquet columns a record is read from; None for JSONL lines,
    whose datasets then need `jsonl_path`.
  - `embed_files`: the converter's step for a record whose files lie beside it,
    `(record, data_dir, *, max_video_bytes) -> record with its files`; None when a
    record is whole.
  - `drop_reasons`: every reason a record of the family may be dropped for before
    packing (a source's reasons included).
  """

  name: str
  transform: type[FamilyTransform]
  image_roles: Mapping[str, str]
  drop_reasons: frozenset[DropReason]
  columns: tuple[str, ...] | None = None
  options: type[GroupOptions] = GroupOptions
  transform_args: Callable[[GroupConfig], dict[str, Any]] = _no_transform_args
  embed_files: Callable[[Any, str], Any] | None = None

  @property
  def reads_jsonl(self) -> bool:
    return self.columns is None

  def record_format(self, dataset: DatasetSpec) -> RecordFormat:
    """How `dataset` stores this family's records: the one place that decides."""
    if dataset.array_record_path is not None:
      return RecordFormat.ARRAY_RECORD
    return RecordFormat.JSONL if self.reads_jsonl else RecordFormat.PARQUET

  def source(self, group: GroupConfig, dataset: DatasetSpec, *,
             readers: int = 1,
             row_group_cache_bytes: int = DEFAULT_CACHE_BYTES,
             max_image_bytes: int | None = None) -> RecordSource:
    """The records one dataset of a group contributes, in source order; `readers`: the
    logical shards reading it at once (parquet keeps a row group in hand for each);
    `max_image_bytes`: a parquet row with a larger binary cell is dropped unread."""
    kind = self.record_format(dataset)
    if kind is RecordFormat.ARRAY_RECORD:  # converted: records of any family
      return _converted_source(dataset)
    if kind is RecordFormat.JSONL:
      return JsonlLineSource(dataset.jsonl_path, num_used=dataset.num_used_data,
                             shuffle_lines=group.shuffle_lines, shuffle_seed=group.shuffle_seed)
    return parquet_dataset(dataset.data_dir, dataset.num_used_data, self.columns,
                           dataset.parquet_info_path, readers=readers,
                           cache_bytes=row_group_cache_bytes, max_cell_bytes=max_image_bytes)

  def make_transform(self, config: GroupConfig, /, **common: Any) -> FamilyTransform:
    """The group's transform; `common` holds what every family takes (`group` its index)."""
    roles = {f"{role}_transform": getattr(config, field)
             for role, field in self.image_roles.items()}
    return self.transform(**roles, **self.transform_args(config), **common)


def _converted_source(dataset: DatasetSpec) -> ArrayRecordSource:
  """The dataset's ArrayRecord files, refused when they do not hold the records its
  `dataset_info` states (a conversion killed midway, shards added or removed since)."""
  source = ArrayRecordSource(array_record_files(dataset.array_record_path))
  if dataset.num_records is not None and len(source) != dataset.num_records:
    raise DatasetError(
        f"dataset {dataset.name!r}: its ArrayRecord files hold {len(source)} records, its "
        f"dataset_info says num_total_samples: {dataset.num_records}; the conversion did not "
        "finish or its folder changed since: run `bagel-grain convert` again",
        file=dataset.array_record_path, field="num_total_samples")
  return source
