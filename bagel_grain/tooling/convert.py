"""Converts a config's parquet and JSONL datasets to ArrayRecord files, for global shuffling.

`bagel-grain convert --config X.yaml --out DIR` writes, for every dataset of every
group, `DIR/<group>/<dataset>/<dataset>-NNNNN-of-MMMMM.array_record`, then
`DIR/dataset_info.yaml` pointing at them and `DIR/config.yaml`: the same config
(same `grouped_datasets`) reading the converted data.

What is converted is what the group reads: `num_used_data` (parquet files repeated,
JSONL lines cut) and `shuffle_lines` are applied here, in the source's order, and
not again when reading. Each record is framed without pickle (`sources/framing.py`):
parquet rows keep their columns, images as their original encoded bytes; a JSONL
line is kept verbatim, with the image files it references (every frame of a video
folder, the file of a video) embedded under the relative path the line spells, read
through the same `DiskFiles` the VLM family reads from disk: a file that is missing is
left out and each refusal is recorded with its reason, so each record drops for the
same reason as when read from disk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import sys
from typing import Any, Callable

import pyarrow as pa
import yaml
from array_record.python import array_record_module

from bagel_grain import fs
from bagel_grain.config import DatasetSpec, GroupConfig, PipelineConfig, load_config
from bagel_grain.errors import DatasetError
from bagel_grain.families.video import DEFAULT_MAX_VIDEO_BYTES
from bagel_grain.sources import framing
from bagel_grain.sources.array_record import SUFFIX
from bagel_grain.sources.base import RecordSource

DEFAULT_RECORDS_PER_SHARD = 4096
# One record per chunk: random access reads exactly one record. Images are already
# compressed, so the chunks are not.
DEFAULT_WRITER_OPTIONS = "group_size:1,uncompressed"
_CHUNK = 256  # JSONL lines whose files are read concurrently


@dataclasses.dataclass(frozen=True)
class ConvertedDataset:
  group: str
  name: str
  num_records: int
  files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Conversion:
  """What `convert_config` wrote."""

  dataset_info: str
  config: str | None
  datasets: tuple[ConvertedDataset, ...]


# --- one dataset --------------------------------------------------------------------


def _file_name(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "dataset"


def _prepare_folder(folder: str, overwrite: bool) -> None:
  os.makedirs(folder, exist_ok=True)
  existing = [f for f in os.listdir(folder) if f.endswith(SUFFIX)]
  if existing and not overwrite:
    raise DatasetError(f"the output folder already holds {len(existing)} {SUFFIX} files; "
                       "pass overwrite=True (`--overwrite`) to replace them", file=folder)
  for f in existing:
    os.remove(os.path.join(folder, f))


def _framed_records(group: GroupConfig, dataset: DatasetSpec, source: RecordSource, start: int,
                    stop: int, pool: concurrent.futures.Executor, max_video_bytes: int):
  """The framed records `start:stop` of the source, in order, with their files embedded."""
  embed = group.family.embed_files

  def read(index: int):
    try:
      fields = source[index]
    except (OSError, pa.ArrowException) as e:
      raise DatasetError(f"cannot read record {source.record_id(index)}: {e}",
                         file=dataset.jsonl_path or dataset.data_dir) from None
    if embed is not None:
      fields = embed(fields, dataset.data_dir, max_video_bytes=max_video_bytes)
    try:
      return framing.encode(fields, origin=source.record_id(index))
    except TypeError as e:
      raise DatasetError(f"record {source.record_id(index)} cannot be framed: {e}",
                         file=dataset.data_dir) from None

  if embed is None:
    # Whole records (parquet rows) come from a row-group cache: read in order, one thread.
    yield from (read(i) for i in range(start, stop))
    return
  for chunk in range(start, stop, _CHUNK):
    yield from pool.map(read, range(chunk, min(chunk + _CHUNK, stop)))


def convert_dataset(group: GroupConfig, dataset: DatasetSpec, out_dir: str, *,
                    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
                    writer_options: str = DEFAULT_WRITER_OPTIONS, overwrite: bool = False,
                    num_threads: int = 16,
                    progress: Callable[[int, int], None] | None = None,
                    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES) -> list[str]:
  """Writes the records `group` reads from `dataset` as ArrayRecord shards in `out_dir`.

  A video file over `max_video_bytes` is not read (the record notes `file_too_large`).
  Returns the shard paths. `progress(written, total)` is called after every record written.
  """
  if dataset.array_record_path is not None:
    raise DatasetError("the dataset is already ArrayRecord; nothing to convert",
                       file=dataset.array_record_path, field="array_record_path")
  if records_per_shard < 1:
    raise ValueError(f"records_per_shard must be >= 1, got {records_per_shard}")
  source = group.family.source(group, dataset)
  total = len(source)
  if total == 0:
    raise DatasetError(f"dataset {dataset.name!r} of group {group.name!r} has no records",
                       file=dataset.jsonl_path or dataset.data_dir)
  _prepare_folder(out_dir, overwrite)
  num_shards = -(-total // records_per_shard)
  stem = _file_name(dataset.name)
  paths, written = [], 0
  with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
    for shard in range(num_shards):
      path = os.path.join(out_dir, f"{stem}-{shard:05d}-of-{num_shards:05d}{SUFFIX}")
      partial = path + ".partial"  # not `*.array_record` until it is whole
      start, stop = shard * records_per_shard, min((shard + 1) * records_per_shard, total)
      writer = array_record_module.ArrayRecordWriter(partial, writer_options)
      try:
        for record in _framed_records(group, dataset, source, start, stop, pool,
                                      max_video_bytes):
          writer.write(record)
          written += 1
          if progress is not None:
            progress(written, total)
      finally:
        writer.close()
      os.replace(partial, path)
      paths.append(path)
  return paths


# --- a whole config -----------------------------------------------------------------


def convert_config(cfg: PipelineConfig, out_dir: str | os.PathLike, *,
                   records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
                   writer_options: str = DEFAULT_WRITER_OPTIONS, overwrite: bool = False,
                   num_threads: int = 16, progress: bool = False) -> Conversion:
  """Converts every dataset of every group and writes `out_dir/dataset_info.yaml`.

  The written `dataset_info` holds, per group, exactly the datasets converted, so a
  config with the same `grouped_datasets` and `dataset_info: out_dir/dataset_info.yaml`
  reads the ArrayRecord files.
  """
  out_dir = os.path.abspath(os.fspath(out_dir))
  os.makedirs(out_dir, exist_ok=True)
  info: dict[str, dict[str, Any]] = {}
  converted = []
  for g in cfg.groups:
    for d in g.datasets:
      folder = os.path.join(out_dir, _file_name(g.name), _file_name(d.name))
      bar = _Progress(f"{g.name}/{d.name}") if progress else None
      try:
        files = convert_dataset(g, d, folder, records_per_shard=records_per_shard,
                                writer_options=writer_options, overwrite=overwrite,
                                num_threads=num_threads, progress=bar,
                                max_video_bytes=cfg.max_video_bytes)
      finally:
        if bar is not None:
          bar.close()
      total = sum(_count(f) for f in files)
      relative = os.path.relpath(folder, out_dir)
      info.setdefault(g.name, {})[d.name] = {
          "data_dir": relative, "array_record_path": relative, "num_total_samples": total}
      converted.append(ConvertedDataset(g.name, d.name, total, tuple(files)))
  info_path = os.path.join(out_dir, "dataset_info.yaml")
  header = ("# Written by `bagel-grain convert`: the datasets as ArrayRecord files. They hold\n"
            "# exactly the records each group reads: num_used_data and shuffle_lines were\n"
            "# applied when converting and are not applied again.\n")
  with open(info_path, "w", encoding="utf-8") as f:
    f.write(header + yaml.safe_dump(info, sort_keys=False))
  return Conversion(info_path, None, tuple(converted))


def _count(path: str) -> int:
  reader = array_record_module.ArrayRecordReader(path)
  try:
    return reader.num_records()
  finally:
    reader.close()


class _Progress:
  """A tqdm bar on stderr for one dataset, opened at the first record, when its total is known."""

  def __init__(self, name: str):
    self._name, self._bar = name, None

  def __call__(self, written: int, total: int) -> None:
    if self._bar is None:
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm(desc=self._name, unit="record", total=total, file=sys.stderr)
    self._bar.update(written - self._bar.n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def _absolute(value: Any, base_dir: str) -> Any:
  return fs.resolve(value, base_dir) if isinstance(value, str) else value


def convert_config_file(config_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                        records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
                        overwrite: bool = False, num_threads: int = 16,
                        progress: bool = True) -> Conversion:
  """`bagel-grain convert`: converts a YAML config's data and writes `out_dir/config.yaml`.

  `config.yaml` is the given config with `dataset_info` pointing at the converted
  data; its other paths (`tokenizer_path`, a `grouped_datasets` file) made absolute.
  """
  config_path = os.path.abspath(os.fspath(config_path))
  cfg = load_config(config_path)
  done = convert_config(cfg, out_dir, records_per_shard=records_per_shard, overwrite=overwrite,
                        num_threads=num_threads, progress=progress)
  base_dir = os.path.dirname(config_path)
  raw = yaml.safe_load(fs.read_bytes(config_path).decode("utf-8"))
  raw["dataset_info"] = "dataset_info.yaml"
  raw["grouped_datasets"] = _absolute(raw["grouped_datasets"], base_dir)
  for section in (raw, raw.get("dataset")):
    if isinstance(section, dict) and isinstance(section.get("tokenizer_path"), str):
      section["tokenizer_path"] = _absolute(section["tokenizer_path"], base_dir)
  path = os.path.join(os.path.dirname(done.dataset_info), "config.yaml")
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"# {config_path}, reading the data converted to ArrayRecord by "
            "`bagel-grain convert`.\n" + yaml.safe_dump(raw, sort_keys=False))
  return dataclasses.replace(done, config=path)
