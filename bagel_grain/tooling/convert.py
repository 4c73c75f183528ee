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
import shutil
import sys
import tempfile
import uuid
from typing import Any, Callable, Sequence

import pyarrow as pa
import yaml
from array_record.python import array_record_module

from bagel_grain import fs
from bagel_grain.config import DatasetSpec, GroupConfig, PipelineConfig, load_config
from bagel_grain.errors import DatasetError
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


# --- one dataset ---------------------------------------------------------------------


def _file_name(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "dataset"


def _prepare_folder(folder: str, overwrite: bool) -> None:
  """Creates `folder` (local) and refuses, or with `overwrite` deletes, the shards in it."""
  if not fs.is_uri(folder):
    os.makedirs(folder, exist_ok=True)
  existing = fs.list_files(folder, SUFFIX) if fs.is_dir(folder) else []
  if existing and not overwrite:
    raise DatasetError(f"the output folder already holds {len(existing)} {SUFFIX} files; "
                       "pass overwrite=True (`--overwrite`) to replace them", file=folder)
  for path in existing:
    filesystem, name = fs.filesystem(path)
    filesystem.delete_file(name)


@dataclasses.dataclass(frozen=True)
class ShardTask:
  """One output file: records [start, stop) of one dataset of one group, the unit of work
  a runner hands out. Its content depends on nothing else, so any worker, or a retry,
  writes the same bytes."""

  group: int
  dataset: int
  shard: int
  start: int
  stop: int
  path: str


def plan_dataset(cfg: PipelineConfig, group: int, dataset: int, out_dir: str,
                 records_per_shard: int) -> list[ShardTask]:
  """The shards of one dataset: `records_per_shard` records each, in source order."""
  g, d = cfg.groups[group], cfg.groups[group].datasets[dataset]
  if d.array_record_path is not None:
    raise DatasetError("the dataset is already ArrayRecord; nothing to convert",
                       file=d.array_record_path, field="array_record_path")
  if records_per_shard < 1:
    raise ValueError(f"records_per_shard must be >= 1, got {records_per_shard}")
  total = len(g.family.source(g, d))
  if total == 0:
    raise DatasetError(f"dataset {d.name!r} of group {g.name!r} has no records",
                       file=d.jsonl_path or d.data_dir)
  num_shards = -(-total // records_per_shard)
  stem = _file_name(d.name)
  return [ShardTask(group, dataset, shard, shard * records_per_shard,
                    min((shard + 1) * records_per_shard, total),
                    fs.join(out_dir, f"{stem}-{shard:05d}-of-{num_shards:05d}{SUFFIX}"))
          for shard in range(num_shards)]


def shard_source(cfg: PipelineConfig, task: ShardTask) -> tuple[RecordSource, int]:
  """(source, index of the task's first record in it): for a source of one record per
  block (JSONL lines), just the task's records are loaded."""
  g = cfg.groups[task.group]
  source = g.family.source(g, g.datasets[task.dataset])
  if source.num_blocks() == len(source):
    return source.restrict(task.start, task.stop), 0
  return source, task.start


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


def write_shard(cfg: PipelineConfig, task: ShardTask, source: RecordSource, first: int, *,
                writer_options: str = DEFAULT_WRITER_OPTIONS,
                pool: concurrent.futures.Executor,
                progress: Callable[[int], None] | None = None) -> int:
  """Writes the task's records (from `source[first:]`) to its path; returns their count.

  The shard is written to a local file of its own (a name no other attempt uses), then
  moved or uploaded whole: a reader, or an attempt running beside a retry, never sees
  part of a shard, and a retried task replaces the shard with the same bytes.
  """
  g = cfg.groups[task.group]
  d = g.datasets[task.dataset]
  staging = (tempfile.mkdtemp(prefix="bagel-grain-shard-") if fs.is_uri(task.path) else None)
  local = (os.path.join(staging, os.path.basename(task.path)) if staging
           else f"{task.path}.partial-{uuid.uuid4().hex}")  # not `*.array_record` until whole
  written = 0
  try:
    writer = array_record_module.ArrayRecordWriter(local, writer_options)
    try:
      for record in _framed_records(g, d, source, first, first + task.stop - task.start, pool,
                                    cfg.max_video_bytes):
        writer.write(record)
        written += 1
        if progress is not None:
          progress(1)
    finally:
      writer.close()
    if staging:
      with open(local, "rb") as f, fs.open_output(task.path) as out:
        shutil.copyfileobj(f, out, 8 << 20)
    else:
      os.replace(local, task.path)
  finally:
    if staging:
      shutil.rmtree(staging, ignore_errors=True)
    elif os.path.exists(local):
      os.remove(local)
  return written


# --- a whole config -----------------------------------------------------------------


def dataset_folder(out_dir: str, group: GroupConfig, dataset: DatasetSpec) -> str:
  return fs.join(out_dir, _file_name(group.name), _file_name(dataset.name))


def plan_config(cfg: PipelineConfig, out_dir: str, *, records_per_shard: int,
                overwrite: bool) -> list[ShardTask]:
  """Every shard of every dataset, their folders made ready (or refused: `overwrite`)."""
  tasks = []
  for gi, g in enumerate(cfg.groups):
    for di, d in enumerate(g.datasets):
      folder = dataset_folder(out_dir, g, d)
      planned = plan_dataset(cfg, gi, di, folder, records_per_shard)
      _prepare_folder(folder, overwrite)
      tasks.extend(planned)
  return tasks


def write_dataset_info(cfg: PipelineConfig, out_dir: str,
                       tasks: Sequence[ShardTask]) -> Conversion:
  """Writes `out_dir/dataset_info.yaml` for the shards of `tasks` (all written)."""
  info: dict[str, dict[str, Any]] = {}
  converted = []
  for gi, g in enumerate(cfg.groups):
    for di, d in enumerate(g.datasets):
      mine = [t for t in tasks if (t.group, t.dataset) == (gi, di)]
      total = sum(t.stop - t.start for t in mine)
      relative = f"{_file_name(g.name)}/{_file_name(d.name)}"
      info.setdefault(g.name, {})[d.name] = {
          "data_dir": relative, "array_record_path": relative, "num_total_samples": total}
      converted.append(ConvertedDataset(g.name, d.name, total, tuple(t.path for t in mine)))
  info_path = fs.join(out_dir, "dataset_info.yaml")
  header = ("# Written by `bagel-grain convert`: the datasets as ArrayRecord files. They hold\n"
            "# exactly the records each group reads: num_used_data and shuffle_lines were\n"
            "# applied when converting and are not applied again.\n")
  fs.write_bytes(info_path, (header + yaml.safe_dump(info, sort_keys=False)).encode("utf-8"))
  return Conversion(info_path, None, tuple(converted))


def output_dir(out_dir: str | os.PathLike) -> str:
  out_dir = os.fspath(out_dir)
  if fs.is_uri(out_dir):
    return out_dir.rstrip("/")
  out_dir = os.path.abspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  return out_dir


def convert_config(cfg: PipelineConfig, out_dir: str | os.PathLike, *,
                   records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
                   writer_options: str = DEFAULT_WRITER_OPTIONS, overwrite: bool = False,
                   num_threads: int = 16, progress: bool = False) -> Conversion:
  """Converts every dataset of every group in this process; writes `out_dir/dataset_info.yaml`.

  The written `dataset_info` holds, per group, exactly the datasets converted, so a
  config with the same `grouped_datasets` and `dataset_info: out_dir/dataset_info.yaml`
  reads the ArrayRecord files. `out_dir` may be a gs:// or s3:// URI (each shard is
  written locally, then uploaded). `bagel-grain convert --runner` writes the same files
  from a Beam pipeline (`tooling/beam_convert.py`).
  """
  out_dir = output_dir(out_dir)
  tasks = plan_config(cfg, out_dir, records_per_shard=records_per_shard, overwrite=overwrite)
  with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
    for gi, g in enumerate(cfg.groups):
      for di, d in enumerate(g.datasets):
        mine = [t for t in tasks if (t.group, t.dataset) == (gi, di)]
        bar = _Progress(f"{g.name}/{d.name}", mine[-1].stop) if progress else None
        try:
          source = g.family.source(g, d)
          for task in mine:
            write_shard(cfg, task, source, task.start, writer_options=writer_options, pool=pool,
                        progress=bar)
        finally:
          if bar is not None:
            bar.close()
  return write_dataset_info(cfg, out_dir, tasks)


class _Progress:
  """A tqdm bar on stderr for one dataset, opened at the first record."""

  def __init__(self, name: str, total: int):
    self._name, self._total, self._bar = name, total, None

  def __call__(self, n: int) -> None:
    if self._bar is None:
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm(desc=self._name, unit="record", total=self._total, file=sys.stderr)
    self._bar.update(n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def _absolute(value: Any, base_dir: str) -> Any:
  return fs.resolve(value, base_dir) if isinstance(value, str) else value


def write_converted_config(config_path: str, done: Conversion) -> Conversion:
  """Writes `config.yaml` beside the converted `dataset_info.yaml`: the config at
  `config_path` reading the converted data, its other paths (`tokenizer_path`, a
  `grouped_datasets` file) made absolute."""
  base_dir = fs.dirname(config_path)
  raw = yaml.safe_load(fs.read_bytes(config_path).decode("utf-8"))
  raw["dataset_info"] = "dataset_info.yaml"
  raw["grouped_datasets"] = _absolute(raw["grouped_datasets"], base_dir)
  for section in (raw, raw.get("dataset")):
    if isinstance(section, dict) and isinstance(section.get("tokenizer_path"), str):
      section["tokenizer_path"] = _absolute(section["tokenizer_path"], base_dir)
  path = fs.join(fs.dirname(done.dataset_info), "config.yaml")
  fs.write_bytes(path, (f"# {config_path}, reading the data converted to ArrayRecord by "
                        "`bagel-grain convert`.\n" + yaml.safe_dump(raw, sort_keys=False)
                        ).encode("utf-8"))
  return dataclasses.replace(done, config=path)


def config_path_of(config_path: str | os.PathLike) -> str:
  config_path = os.fspath(config_path)
  return config_path if fs.is_uri(config_path) else os.path.abspath(config_path)


def convert_config_file(config_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                        records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
                        overwrite: bool = False, num_threads: int = 16,
                        progress: bool = True) -> Conversion:
  """`bagel-grain convert` in this process: converts a YAML config's data and writes
  `out_dir/config.yaml` (see `write_converted_config`)."""
  config_path = config_path_of(config_path)
  done = convert_config(load_config(config_path), out_dir, records_per_shard=records_per_shard,
                        overwrite=overwrite, num_threads=num_threads, progress=progress)
  return write_converted_config(config_path, done)
