"""Converts a config's parquet and JSONL datasets to ArrayRecord files, for global shuffling.

`bagel-grain convert --config X.yaml --out DIR` writes, for every dataset of every
group, `DIR/<group>/<dataset>/<dataset>-NNNNN-of-MMMMM.array_record`, then
`DIR/dataset_info.yaml` pointing at them and, last, `DIR/config.yaml`: the same config
(same `grouped_datasets`, inline) reading the converted data. `DIR` names no file of
the source: a record's `origin` is its id under its dataset's root, so the same data
converted from two folders gives the same bytes.

The same command after a kill resumes: the config files were deleted before any shard
was touched, partial files are deleted, and each shard already there is kept when it
verifies against the plan (`shard_is_complete`), else written again.

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
import posixpath
import re
import shutil
import sys
import tempfile
import uuid
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import yaml
from array_record.python import array_record_module

from bagel_grain import fs
from bagel_grain.config import DatasetSpec, GroupConfig, PipelineConfig, load_config
from bagel_grain.errors import DatasetError
from bagel_grain.sources import framing
from bagel_grain.sources.array_record import SUFFIX
from bagel_grain.sources.base import RecordSource
from bagel_grain.sources.records import dataset_roots, location_free_id

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
  skipped: int = 0  # JSONL lines longer than the text bound, not converted


@dataclasses.dataclass(frozen=True)
class Conversion:
  """What `convert_config` wrote."""

  dataset_info: str
  config: str | None
  datasets: tuple[ConvertedDataset, ...]


# --- one dataset ---------------------------------------------------------------------


def _file_name(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "dataset"


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
  max_line_bytes: int | None = None  # a longer JSONL line is not converted (`text_bound`)


def plan_dataset(cfg: PipelineConfig, group: int, dataset: int, out_dir: str,
                 records_per_shard: int, max_line_bytes: int | None = None) -> list[ShardTask]:
  """The shards of one dataset: `records_per_shard` records each, in source order (JSONL
  lines longer than `max_line_bytes` left out when written, see `skipped`)."""
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
                    fs.join(out_dir, f"{stem}-{shard:05d}-of-{num_shards:05d}{SUFFIX}"),
                    max_line_bytes)
          for shard in range(num_shards)]


def text_bound(cfg: PipelineConfig) -> int | None:
  """The most characters of text a sample can hold (the loader's `text_too_long` bound):
  a JSONL line longer than that in bytes is one no sample of the loader's can read whole.
  None without a tokenizer."""
  from bagel_grain.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  if cfg.tokenizer_path is None:
    return None
  return cfg.max_num_tokens_per_sample * load_tokenizer(cfg.tokenizer_path).longest_token_chars


def skipped(task: ShardTask, source: RecordSource, first: int) -> frozenset[int]:
  """The source indices of the task's JSONL lines longer than its `max_line_bytes`: not
  converted. Decided from the line index, so such a line is never read (one of a
  gigabyte is not loaded to be copied)."""
  lengths = getattr(source, "line_lengths", None)
  if task.max_line_bytes is None or lengths is None:
    return frozenset()
  span = lengths()[first:first + task.stop - task.start]
  return frozenset(first + int(i) for i in np.flatnonzero(span > task.max_line_bytes))


def shard_source(cfg: PipelineConfig, task: ShardTask) -> tuple[RecordSource, int]:
  """(source, index of the task's first record in it): for a source of one record per
  block (JSONL lines), just the task's records are loaded."""
  g = cfg.groups[task.group]
  source = g.family.source(g, g.datasets[task.dataset])
  if source.num_blocks() == len(source):
    return source.restrict(task.start, task.stop), 0
  return source, task.start


def origin(source: RecordSource, index: int, dataset: str, roots: Sequence[str | None]) -> str:
  """A converted record's `origin`: its record id under its dataset's root
  (`dataset/file:line`), the same wherever the source lay."""
  return location_free_id(source.record_id(index), dataset, roots)


def _framed_records(group: GroupConfig, dataset: DatasetSpec, source: RecordSource, start: int,
                    stop: int, pool: concurrent.futures.Executor, max_video_bytes: int,
                    skip: frozenset = frozenset()):
  """The framed records `start:stop` of the source but `skip`, in order, with their files
  embedded."""
  embed = group.family.embed_files
  roots = dataset_roots(dataset)

  def read(index: int):
    try:
      fields = source[index]
    except (OSError, pa.ArrowException) as e:
      raise DatasetError(f"cannot read record {source.record_id(index)}: {e}",
                         file=dataset.jsonl_path or dataset.data_dir) from None
    if embed is not None:
      fields = embed(fields, dataset.data_dir, max_video_bytes=max_video_bytes)
    try:
      return framing.encode(fields, origin=origin(source, index, dataset.name, roots))
    except TypeError as e:
      raise DatasetError(f"record {source.record_id(index)} cannot be framed: {e}",
                         file=dataset.data_dir) from None

  wanted = [i for i in range(start, stop) if i not in skip]
  if embed is None:
    # Whole records (parquet rows) come from a row-group cache: read in order, one thread.
    yield from (read(i) for i in wanted)
    return
  for chunk in range(0, len(wanted), _CHUNK):
    yield from pool.map(read, wanted[chunk:chunk + _CHUNK])


def write_shard(cfg: PipelineConfig, task: ShardTask, source: RecordSource, first: int, *,
                writer_options: str = DEFAULT_WRITER_OPTIONS,
                pool: concurrent.futures.Executor,
                progress: Callable[[int], None] | None = None) -> int:
  """Writes the task's records (from `source[first:]`) to its path; returns their count. A
  shard already complete (`shard_is_complete`) is kept: a run killed midway resumes.

  The shard is written to a local file of its own (a name no other attempt uses), then
  moved or uploaded whole: a reader, or an attempt running beside a retry, never sees
  part of a shard, and a retried task replaces the shard with the same bytes.
  """
  g = cfg.groups[task.group]
  d = g.datasets[task.dataset]
  if shard_is_complete(task, source, first, d, writer_options):
    if progress is not None:
      progress(task.stop - task.start)
    return task.stop - task.start - len(skipped(task, source, first))  # an earlier run's
  staging = (tempfile.mkdtemp(prefix="bagel-grain-shard-") if fs.is_uri(task.path) else None)
  local = (os.path.join(staging, os.path.basename(task.path)) if staging
           else f"{task.path}{PARTIAL}{uuid.uuid4().hex}")  # not `*.array_record` until whole
  written = 0
  try:
    writer = array_record_module.ArrayRecordWriter(local, writer_options)
    try:
      skip = skipped(task, source, first)
      if progress is not None and skip:
        progress(len(skip))  # passed over
      for record in _framed_records(g, d, source, first, first + task.stop - task.start, pool,
                                    cfg.max_video_bytes, skip):
        writer.write(record)
        written += 1
        if progress is not None:
          progress(1)
    finally:
      writer.close()
    if staging:
      fs.upload_file(local, task.path)
    else:
      os.replace(local, task.path)
  finally:
    if staging:
      shutil.rmtree(staging, ignore_errors=True)
    elif os.path.exists(local):
      os.remove(local)
  return written


def shard_is_complete(task: ShardTask, source: RecordSource, first: int, dataset: DatasetSpec,
                      writer_options: str = DEFAULT_WRITER_OPTIONS) -> bool:
  """Whether the task's file holds exactly what the plan says, so a resumed run keeps it:
  it opens (its footer is whole), was written with `writer_options`, holds the planned
  number of records, and each record, read through ArrayRecord's chunk checksums, is
  the planned one (its `origin`), in order. A shard in a bucket is downloaded to be read
  (ArrayRecord reads local files only): cheaper than writing it again."""
  if not fs.exists(task.path) or fs.is_dir(task.path):
    return False
  skip, roots = skipped(task, source, first), dataset_roots(dataset)
  expected = [origin(source, i, dataset.name, roots)
              for i in range(first, first + task.stop - task.start) if i not in skip]
  if not fs.is_uri(task.path):
    return _holds(task.path, expected, writer_options)
  staging = tempfile.mkdtemp(prefix="bagel-grain-shard-")
  try:
    local = os.path.join(staging, os.path.basename(task.path))
    fs.download_file(task.path, local)
    return _holds(local, expected, writer_options)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def _holds(path: str, expected: Sequence[str], writer_options: str) -> bool:
  """Whether the local ArrayRecord file holds records of exactly these origins, in order,
  written with `writer_options`."""
  try:
    reader = array_record_module.ArrayRecordReader(path)
  except (RuntimeError, ValueError, OSError):
    return False
  try:
    if (not reader.ok() or reader.num_records() != len(expected) or not set(
        writer_options.split(",")) <= set(reader.writer_options_string().split(","))):
      return False
    for begin in range(0, len(expected), _CHUNK):
      records = reader.read(begin, min(begin + _CHUNK, len(expected)))
      if [framing.origin(r) for r in records] != list(expected[begin:begin + len(records)]):
        return False
    return True
  except (RuntimeError, ValueError, OSError):  # FramingError is a ValueError
    return False
  finally:
    try:
      reader.close()
    except (RuntimeError, ValueError, OSError):  # a damaged file fails to close too
      pass


# --- a whole config -----------------------------------------------------------------


def dataset_folder(out_dir: str, group: GroupConfig, dataset: DatasetSpec) -> str:
  return fs.join(out_dir, _file_name(group.name), _file_name(dataset.name))


def plan_config(cfg: PipelineConfig, out_dir: str, *, records_per_shard: int,
                overwrite: bool) -> list[ShardTask]:
  """Every shard of every dataset, the output made ready for them (`prepare_output`)."""
  bound = text_bound(cfg) if any(g.family.reads_jsonl for g in cfg.groups) else None
  tasks = []
  for gi, g in enumerate(cfg.groups):
    for di, d in enumerate(g.datasets):
      tasks += plan_dataset(cfg, gi, di, dataset_folder(out_dir, g, d), records_per_shard,
                            bound)
  prepare_output(out_dir, tasks, overwrite)
  return tasks


CONFIG_FILES = ("config.yaml", "dataset_info.yaml")
PARTIAL = ".partial-"  # `write_shard`'s local file, until it is whole


def partial_files(folder: str) -> list[str]:
  """Shards being written, or left by a run killed while writing them (local folders)."""
  if fs.is_uri(folder) or not os.path.isdir(folder):
    return []
  return sorted(os.path.join(folder, n) for n in os.listdir(folder) if SUFFIX + PARTIAL in n)


def prepare_output(out_dir: str, tasks: Sequence[ShardTask], overwrite: bool) -> None:
  """Readies the output for the plan `tasks`, before any shard is written.

  A shard the plan does not write (another conversion's) is refused, or with
  `overwrite` deleted with every other shard. The config files go first: until the
  run writes them last, the folder is no dataset a loader could read half of. Partial
  files of a killed run are removed; the shards it finished stay for `write_shard`
  to keep (resume) once it has verified them.
  """
  planned = {t.path for t in tasks}
  folders = sorted({fs.dirname(t.path) for t in tasks})
  existing = [p for f in folders if fs.is_dir(f) for p in fs.list_files(f, SUFFIX)]
  strangers = [p for p in existing if p not in planned]
  if strangers and not overwrite:
    raise DatasetError(f"the output folder holds {len(strangers)} {SUFFIX} files this "
                       "conversion does not write (another config's or records_per_shard's); "
                       "pass overwrite=True (`--overwrite`) to replace them", file=strangers[0])
  for name in CONFIG_FILES:
    path = fs.join(out_dir, name)
    if fs.exists(path):
      fs.delete(path)
  for folder in folders:
    if not fs.is_uri(folder):
      os.makedirs(folder, exist_ok=True)
    for path in partial_files(folder):
      os.remove(path)
  if overwrite:
    for path in existing:
      fs.delete(path)


def finish(cfg: PipelineConfig, out_dir: str, tasks: Sequence[ShardTask],
           written: Mapping[str, int], config_path: str | None) -> Conversion:
  """Once every shard is written (`written`: records per shard path): removes what killed
  attempts left (partial files), then writes `dataset_info.yaml` and, last, `config.yaml`
  (with `config_path`)."""
  for folder in sorted({fs.dirname(t.path) for t in tasks}):
    for path in partial_files(folder):
      os.remove(path)
  done = write_dataset_info(cfg, out_dir, tasks, written)
  return done if config_path is None else write_converted_config(config_path, done)


def write_dataset_info(cfg: PipelineConfig, out_dir: str, tasks: Sequence[ShardTask],
                       written: Mapping[str, int]) -> Conversion:
  """Writes `out_dir/dataset_info.yaml` for the shards of `tasks` (`written`: the records
  each holds): paths relative to it, and each dataset's record count, which the loader
  checks against its files."""
  info: dict[str, dict[str, Any]] = {}
  converted, notes = [], []
  for gi, g in enumerate(cfg.groups):
    for di, d in enumerate(g.datasets):
      mine = [t for t in tasks if (t.group, t.dataset) == (gi, di)]
      total = sum(written[t.path] for t in mine)
      left_out = sum(t.stop - t.start for t in mine) - total
      relative = f"{_file_name(g.name)}/{_file_name(d.name)}"
      info.setdefault(g.name, {})[d.name] = {
          "data_dir": relative, "array_record_path": relative, "num_total_samples": total}
      converted.append(ConvertedDataset(g.name, d.name, total, tuple(t.path for t in mine),
                                        left_out))
      if left_out:
        notes.append(f"# {g.name}/{d.name}: {left_out} lines longer than the text bound not "
                     "converted\n")
  info_path = fs.join(out_dir, "dataset_info.yaml")
  header = ("# Written by `bagel-grain convert`: the datasets as ArrayRecord files. They hold\n"
            "# exactly the records each group reads: num_used_data and shuffle_lines were\n"
            "# applied when converting and are not applied again.\n") + "".join(notes)
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
                   num_threads: int = 16, progress: bool = False,
                   config_path: str | None = None) -> Conversion:
  """Converts every dataset of every group in this process; writes `out_dir/dataset_info.yaml`
  (and `config.yaml`, from the config file `config_path`, see `write_converted_config`).

  The written `dataset_info` holds, per group, exactly the datasets converted, so a
  config with the same `grouped_datasets` and `dataset_info: out_dir/dataset_info.yaml`
  reads the ArrayRecord files. `out_dir` may be a gs:// or s3:// URI (each shard is
  written locally, then uploaded). `bagel-grain convert --runner` writes the same files
  from a Beam pipeline (`tooling/beam_convert.py`).
  """
  out_dir = output_dir(out_dir)
  tasks = plan_config(cfg, out_dir, records_per_shard=records_per_shard, overwrite=overwrite)
  written: dict[str, int] = {}
  with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
    for gi, g in enumerate(cfg.groups):
      for di, d in enumerate(g.datasets):
        mine = [t for t in tasks if (t.group, t.dataset) == (gi, di)]
        bar = _Progress(f"{g.name}/{d.name}", mine[-1].stop) if progress else None
        try:
          source = g.family.source(g, d)
          for task in mine:
            written[task.path] = write_shard(cfg, task, source, task.start, pool=pool,
                                             writer_options=writer_options, progress=bar)
        finally:
          if bar is not None:
            bar.close()
  return finish(cfg, out_dir, tasks, written, config_path)


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


def write_converted_config(config_path: str, done: Conversion) -> Conversion:
  """Writes `config.yaml` beside the converted `dataset_info.yaml`: the config at
  `config_path` reading the converted data, self-contained: its `grouped_datasets`
  inline (a file it named is read), so the source may move or go; `tokenizer_path`
  made absolute (the tokenizer is no part of the corpus)."""
  base_dir = fs.dirname(config_path)
  raw = yaml.safe_load(fs.read_bytes(config_path).decode("utf-8"))
  raw["dataset_info"] = "dataset_info.yaml"
  if isinstance(raw["grouped_datasets"], str):
    raw["grouped_datasets"] = yaml.safe_load(fs.read_bytes(
        fs.resolve(raw["grouped_datasets"], base_dir)).decode("utf-8"))
  for section in (raw, raw.get("dataset")):
    if isinstance(section, dict) and isinstance(section.get("tokenizer_path"), str):
      section["tokenizer_path"] = fs.resolve(section["tokenizer_path"], base_dir)
  path = fs.join(fs.dirname(done.dataset_info), "config.yaml")
  fs.write_bytes(path, (f"# {posixpath.basename(config_path)}, reading the data converted to "
                        "ArrayRecord by `bagel-grain convert`.\n" +
                        yaml.safe_dump(raw, sort_keys=False)).encode("utf-8"))
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
  return convert_config(load_config(config_path), out_dir, records_per_shard=records_per_shard,
                        overwrite=overwrite, num_threads=num_threads, progress=progress,
                        config_path=config_path)
