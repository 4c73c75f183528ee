"""`bagel-grain index --runner R`: the sidecar index written by a Beam pipeline.

The work is split finer than a folder or a file: parquet footers are read in runs
of `FILES_PER_TASK` files, and every JSONL file is scanned in byte ranges of `split_bytes` (each range counts the
newlines inside it, so the ranges split the file at line boundaries whatever their
cut), so one huge JSONL file is indexed by many workers. Per folder / file, one
step then assembles the pieces in order and writes the same files, byte for byte,
as `sidecar.index_config` does in one process: both end in the same functions
(`parquet_index_bytes`, `jsonl_index_files`). That step holds a file's line
offsets (8 bytes a line) and shuffles them as upstream does, in one process (a
Python `random.shuffle` cannot be split).

A retried bundle recomputes pure values (footers, newline positions); files are
written only by the last step, whole, so a retry writes the same bytes again.
"""

from __future__ import annotations

import concurrent.futures
from typing import Sequence

import apache_beam as beam

from bagel_grain import fs, io_limits
from bagel_grain.sources import identity, sidecar
from bagel_grain.tooling import beam_runner

DEFAULT_SPLIT_BYTES = 64 << 20  # a JSONL byte range per work item
FILES_PER_TASK = 64  # parquet footers per work item


def folder_files(folder: str, files_per_task: int):
  """folder -> (folder, [(name, identity as listed)]) per run of its parquet files, from
  one listing."""
  files = sidecar.list_parquet_files(folder)
  for start in range(0, len(files), files_per_task):
    yield folder, files[start:start + files_per_task]


def footer_facts(item):
  """(folder, files) -> (folder, (name, identity, facts)) per file; a run's files are read
  on `io_limits.FOOTER_THREADS` threads (an object store's latency overlaps)."""
  folder, files = item
  with concurrent.futures.ThreadPoolExecutor(io_limits.FOOTER_THREADS) as pool:
    done = pool.map(lambda f: sidecar.indexed_parquet_file(fs.join(folder, f[0]), f[1]), files)
    for (name, _), (ident, facts) in zip(files, done):
      yield folder, (name, ident, facts)


def write_folder_index(item) -> str:
  """(folder, [(name, identity, facts)]) -> the index written, files by name."""
  folder, files = item
  files = sorted(files, key=lambda f: f[0])
  path = fs.join(folder, sidecar.PARQUET_INDEX)
  fs.write_bytes(path, sidecar.parquet_index_bytes([f[:2] for f in files],
                                                   [f[2] for f in files]))
  return path


def jsonl_ranges(item: tuple[str, Sequence[int]], split_bytes: int):
  """(path, seeds) -> its byte ranges, each with the file's identity (its checksums read
  before any scan, in this step: a file's MD5 is one sequential pass)."""
  path, seeds = item
  ident = identity.indexed(path, identity.of_listing(fs.file_info(path)), "jsonl")
  for start in range(0, max(ident.size, 1), split_bytes):
    yield path, ident, tuple(seeds), start, min(start + split_bytes, ident.size)


def range_line_ends(item):
  path, ident, seeds, start, stop = item
  return path, (ident, seeds, start, sidecar.line_ends(path, start, stop))


def write_jsonl_index(item) -> list[str]:
  """(path, [(identity, seeds, start, line ends)]) -> the index files written."""
  path, pieces = item
  pieces = sorted(pieces, key=lambda p: p[2])
  ident, seeds = pieces[0][0], pieces[0][1]
  starts = sidecar.line_starts_from_ends([p[3] for p in pieces], ident.size)
  del pieces
  return sidecar.write_jsonl_files(sidecar.jsonl_index_files(path, ident, starts, seeds))


def build(pipeline, cfg, *, split_bytes: int = DEFAULT_SPLIT_BYTES):
  """Adds the index of `cfg`'s data to `pipeline`; returns the PCollection of paths written."""
  parquet_dirs, jsonl_seeds = sidecar.index_targets(cfg)
  written = []
  if parquet_dirs:
    written.append(
        pipeline
        | "parquet folders" >> beam.Create(parquet_dirs)
        | "list" >> beam.FlatMap(folder_files, FILES_PER_TASK)
        | "spread files" >> beam.Reshuffle()
        | "read footers" >> beam.FlatMap(footer_facts)
        | "by folder" >> beam.GroupByKey()
        | "write parquet index" >> beam.Map(write_folder_index))
  if jsonl_seeds:
    written.append(
        pipeline
        | "JSONL files" >> beam.Create(sorted(jsonl_seeds.items()))
        | "byte ranges" >> beam.FlatMap(jsonl_ranges, split_bytes)
        | "spread ranges" >> beam.Reshuffle()
        | "find newlines" >> beam.Map(range_line_ends)
        | "by file" >> beam.GroupByKey()
        | "write JSONL index" >> beam.FlatMap(write_jsonl_index))
  return written | "all written" >> beam.Flatten() if written else None


def run_index(cfg, runner: str, extra: Sequence[str] = (), *,
              split_bytes: int = DEFAULT_SPLIT_BYTES) -> list[str]:
  """Runs the index pipeline to its end; returns the paths written (in `index_config`'s order)."""
  with beam.Pipeline(options=beam_runner.pipeline_options(runner, extra)) as p:
    build(p, cfg, split_bytes=split_bytes)
  with_paths = []
  parquet_dirs, jsonl_seeds = sidecar.index_targets(cfg)
  for folder in parquet_dirs:
    with_paths.append(fs.join(folder, sidecar.PARQUET_INDEX))
  for path, seeds in jsonl_seeds.items():
    with_paths += [path + ".bagel_index.json", path + ".bagel_lines.npy"]
    with_paths += [sidecar.shuffle_path(path, s) for s in seeds]
  return with_paths
