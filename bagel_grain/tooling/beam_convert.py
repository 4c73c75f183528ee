"""`bagel-grain convert --runner R`: the ArrayRecord conversion as a Beam pipeline.

The launching process plans the shards exactly as `convert.convert_config` does
(`convert.plan_config`: `records_per_shard` records of one dataset per file, in
source order) and makes their folders ready; the pipeline hands the shard tasks
out to workers, each writing whole shards with `convert.write_shard`, the
function the in-process path uses. A shard's bytes depend on its task alone, so
they are the same whatever the runner, the worker count or the order of work.

Retries: a worker writes a shard to a local file of its own, then moves or
uploads it whole (`write_shard`). A bundle that fails and is retried writes its
shards again with the same bytes; a shard is never appended to, so a retry can
neither duplicate nor lose a record. The ArrayRecord sink of `array_record.beam`
is not used: it shards by its own rule and writes to local disk only, while this
writes the loader's layout straight to local disk, gs:// or s3://.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Sequence

import apache_beam as beam

from bagel_grain import fs
from bagel_grain.config import load_config
from bagel_grain.tooling import beam_runner, convert

# The records each shard holds, handed back from the workers (deleted once read).
COUNTS = ".bagel_grain_convert_counts.json"


class WriteShards(beam.DoFn):
  """Builds the config and each dataset's source once per worker, then writes the shard
  tasks it is handed. `fail_first` (tests only) names a marker file: the first attempt
  to see it missing creates it and fails midway through a shard."""

  def __init__(self, config_path: str, writer_options: str, num_threads: int,
               fail_first: str | None = None):
    super().__init__()
    self._config_path, self._options = config_path, writer_options
    self._threads, self._fail_first = num_threads, fail_first
    self._cfg = self._pool = None
    self._sources: dict = {}

  def setup(self) -> None:
    self._cfg = load_config(self._config_path)
    self._pool = concurrent.futures.ThreadPoolExecutor(self._threads)

  def teardown(self) -> None:
    if self._pool is not None:
      self._pool.shutdown()

  def process(self, task: convert.ShardTask):
    key = (task.group, task.dataset)
    if self._cfg is None:
      self.setup()
    g = self._cfg.groups[task.group]
    if key not in self._sources:
      self._sources[key] = g.family.source(g, g.datasets[task.dataset])
    source, first = self._sources[key], task.start
    if source.num_blocks() == len(source):  # one record per block: load this task's only
      source, first = convert.shard_source(self._cfg, task)
    progress = self._injected_failure(task) if self._fail_first else None
    yield task, convert.write_shard(self._cfg, task, source, first,
                                    writer_options=self._options, pool=self._pool,
                                    progress=progress)

  def _injected_failure(self, task: convert.ShardTask):
    if os.path.exists(self._fail_first) or task.stop - task.start < 2:
      return None
    seen = [0]

    def fail_midway(n: int) -> None:
      seen[0] += n
      if seen[0] * 2 >= task.stop - task.start and not os.path.exists(self._fail_first):
        with open(self._fail_first, "w", encoding="utf-8") as f:
          f.write(task.path)
        raise RuntimeError(f"injected failure, first attempt at {task.path}")
    return fail_midway


def run_convert(config_path: str | os.PathLike, out_dir: str | os.PathLike, runner: str,
                extra: Sequence[str] = (), *,
                records_per_shard: int = convert.DEFAULT_RECORDS_PER_SHARD,
                writer_options: str = convert.DEFAULT_WRITER_OPTIONS, overwrite: bool = False,
                num_threads: int = 16, fail_first: str | None = None) -> convert.Conversion:
  """Converts the config's data on the runner; writes `dataset_info.yaml` and `config.yaml`
  from here once every shard is written (the same files as `convert_config_file`). Shards
  a killed run finished are kept (`convert.write_shard` verifies them on the workers)."""
  config_path = convert.config_path_of(config_path)
  cfg = load_config(config_path)
  out_dir = convert.output_dir(out_dir)
  tasks = convert.plan_config(cfg, out_dir, records_per_shard=records_per_shard,
                              overwrite=overwrite)
  body = WriteShards(config_path, writer_options, num_threads, fail_first)
  counts = fs.join(out_dir, COUNTS)
  with beam.Pipeline(options=beam_runner.pipeline_options(runner, extra)) as p:
    _ = (p
         | "shard tasks" >> beam.Create(tasks)
         | "spread" >> beam.Reshuffle()
         | "write shards" >> beam.ParDo(body)
         | "records per shard" >> beam.Map(_path_and_count)
         | "gather" >> beam.combiners.ToList()
         | "hand back" >> beam.Map(_write_counts, counts))
  written = json.loads(fs.read_bytes(counts))
  fs.delete(counts)
  return convert.finish(cfg, out_dir, tasks, written, config_path)


def _path_and_count(written: tuple[convert.ShardTask, int]) -> tuple[str, int]:
  return written[0].path, written[1]


def _write_counts(counts: list, path: str) -> None:
  fs.write_bytes(path, json.dumps(dict(counts)).encode())
