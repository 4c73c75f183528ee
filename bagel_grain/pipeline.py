"""The builder: config -> per shard, per group MapDatasets -> mixing -> packing ->
the served shards' rows interleaved -> batching.

Reads like the data's path: source, epoch shuffle and logical shard, family
transform, sample preparation, then the packer stages (docs/architecture.md), one
mixing and packing pair per logical shard the process serves (docs/elastic.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import posixpath
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from bagel_grain import fs, images, io_limits, storage
from bagel_grain.config import STREAM_NEUTRAL_FIELDS, GroupConfig, PipelineConfig
from bagel_grain.errors import ConfigError, DatasetError, StateMismatchError
from bagel_grain.families.base import FamilyTransform
from bagel_grain.packing.batch import BatchDataset, BatchIterator
from bagel_grain.packing.eras import Plan
from bagel_grain.packing.drop_policy import DropPolicy
from bagel_grain.workers import Fetcher
from bagel_grain.packing.layout import Geometry
from bagel_grain.packing.mix import MixDataset, MixSpec, read_ahead
from bagel_grain.packing.pack import PackDataset, PackSpec
from bagel_grain.packing.prepare import PrepareSample
from bagel_grain.packing.row import Capacities, default_capacities
from bagel_grain.packing.shards import ShardInterleaveDataset
from bagel_grain.packing.state import StreamIdentity
from bagel_grain.sources import readahead
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.manifest import Manifest, dataset_manifest, tail_digest
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources.records import ConcatSource, EraStart, ShuffledRecords, dataset_roots


def stream_seeds(cfg: PipelineConfig, seed: int | None = None) -> tuple[int, int]:
  """(record-order seed, sampling seed): what orders the records, and what draws the
  groups, the per-sample choices, dropout and timesteps.

  NeMo orders data with `data_seed` and samples with the trainer's global `seed`; a
  config without `seed` uses `data_seed` for both. An explicit `seed` sets both.
  """
  if seed is not None:
    return seed, seed
  return cfg.data_seed, cfg.data_seed if cfg.seed is None else cfg.seed


def group_seed(seed: int, group: int) -> int:
  """A group's own seed for its record order and its family's RNG."""
  return int(np.random.SeedSequence([seed, group]).generate_state(1)[0])


def shard_count(cfg: PipelineConfig, process_count: int) -> int:
  """S, the logical shards the stream is defined over: the config's, else one per process."""
  return process_count if cfg.logical_shards is None else cfg.logical_shards


def served_shards(cfg: PipelineConfig, process_index: int, process_count: int) -> list[int]:
  """The logical shards process `p` of `P` serves: those with `s % P == p`."""
  count = shard_count(cfg, process_count)
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
  if count < process_count:
    raise ConfigError(f"{process_count} processes cannot serve {count} logical shards: set "
                      f"`logical_shards` to at least the largest process count",
                      key="logical_shards")
  return list(range(process_index, count, process_count))


def rng_shard(cfg: PipelineConfig, shard: int) -> int:
  """The shard number folded into per-sample RNG keys (0 = none, the pre-shard keys).

  Without `logical_shards` the processes keep the keys they had before logical
  shards (bit-identical streams); with it, every shard but 0 gets its own draws.
  """
  return 0 if cfg.logical_shards is None else shard


def family_seed(seed: int, group: int, shard: int) -> int:
  """The seed of a group's family RNG in a shard (`rng_shard`; 0 = `group_seed`)."""
  if not shard:
    return group_seed(seed, group)
  return int(np.random.SeedSequence([seed, group, shard]).generate_state(1)[0])


def group_source(cfg: PipelineConfig, group: int, *, readers: int = 1) -> ConcatSource:
  """All records of a group, dataset after dataset; `readers`: the logical shards that
  read it at once (see `Family.source`)."""
  g = cfg.groups[group]
  return ConcatSource([g.family.source(g, d, readers=readers,
                                       row_group_cache_bytes=cfg.max_row_group_cache_bytes,
                                       max_image_bytes=cfg.max_image_bytes)
                       for d in g.datasets], names=[d.name for d in g.datasets],
                      roots=[dataset_roots(d) for d in g.datasets])


def _check_share(cfg: PipelineConfig, group: int, source: ConcatSource, shards: int) -> None:
  """A group needs a record for each logical shard (rows are shared out when blocks are
  few); else the error names the group, its datasets and their sizes."""
  if source.num_blocks() >= shards or len(source) >= shards:
    return
  g = cfg.groups[group]
  sizes = ", ".join(f"dataset {d.name!r} ({d.array_record_path or d.jsonl_path or d.data_dir}) "
                    f"has {len(s)}" for d, s in zip(g.datasets, source.sources))
  short = ("no records" if not len(source) else
           f"{len(source)} records, fewer than the {shards} logical shards that share it (one "
           "per process unless `logical_shards` is set)")
  raise DatasetError(f"group {g.name!r} has {short} ({sizes}); fill or remove its datasets",
                     file=g.datasets[0].jsonl_path or g.datasets[0].data_dir,
                     field="dataset_names")


def family_transform(cfg: PipelineConfig, group: int, tokenizer) -> FamilyTransform:
  """The group's family transform (Record -> Sample | Dropped)."""
  g = cfg.groups[group]
  common = dict(group=group, tokenizer=tokenizer, max_decode_pixels=cfg.max_decode_pixels,
                max_text_chars=cfg.max_num_tokens_per_sample * tokenizer.longest_token_chars,
                max_image_bytes=cfg.max_image_bytes, max_video_bytes=cfg.max_video_bytes,
                max_video_frames=cfg.max_video_frames, jpeg_draft=cfg.jpeg_draft,
                max_sample_tokens=cfg.max_num_tokens_per_sample)
  return g.family.make_transform(g, **common)


def group_records(cfg: PipelineConfig, group: int, *, seed: int, shard: int = 0,
                  shard_count: int = 1, source: ConcatSource | None = None,
                  sets: Sequence[Sequence[tuple[int, int]]] = (),
                  starts: Sequence[EraStart] = ()) -> ShuffledRecords:
  """One group's records in one logical shard, reshuffled each epoch; `seed` orders them.

  `source` (default: the group's) may be shared by the shards of a process. `sets` and
  `starts`: the group's earlier record sets, when records were appended (`set_blocks`).
  """
  source = group_source(cfg, group) if source is None else source
  _check_share(cfg, group, source, shard_count)
  try:
    return ShuffledRecords(source, seed=group_seed(seed, group), shard_index=shard,
                           shard_count=shard_count, num_epochs=cfg.num_epochs,
                           storage=storage.policy_for(cfg.storage_timeout_s,
                                                      cfg.element_timeout_s),
                           sets=sets, starts=starts)
  except DatasetError as e:
    raise DatasetError(f"group {cfg.groups[group].name!r}: {e}") from e


def set_blocks(cfg: PipelineConfig, group: int, source: ConcatSource,
               datasets: Mapping[str, Manifest]) -> list[tuple[int, int]]:
  """The blocks of the group's `source` that held its records when its datasets were
  `datasets` (a manifest each, of an earlier record set), in their order then; a
  StateMismatchError naming the dataset and file when they are not all still there."""
  g = cfg.groups[group]
  ranges, offset = [], 0
  for spec, part in zip(g.datasets, source.sources):
    saved = datasets.get(spec.name)
    if saved is not None:
      where = f"group {g.name!r}, dataset {spec.name!r} under {saved.root}"
      if spec.num_used_data is not None:
        raise StateMismatchError(f"{where}: records were appended, and the dataset reads "
                                 "`num_used_data` of them, which may be others now: start a "
                                 "new stream (without the state) to take them in")
      for a, b in _kept_blocks(where, part, saved):
        if ranges and ranges[-1][1] == offset + a:  # adjacent files: one range
          ranges[-1] = (ranges[-1][0], offset + b)
        else:
          ranges.append((offset + a, offset + b))
    offset += part.num_blocks()
  return ranges


def grown_source(cfg: PipelineConfig, group: int, source: ConcatSource,
                 sets: Sequence[Mapping[str, Manifest]]) -> ConcatSource:
  """The group's `source` read on from its earlier record sets `sets` (oldest first): a
  JSONL that grew reads the lines it had first, in the order it read them then
  (`JsonlLineSource.grown_from`), so each earlier set is a prefix of its blocks."""
  g = cfg.groups[group]
  parts = []
  for spec, part in zip(g.datasets, source.sources):
    first = next((s[spec.name] for s in sets if spec.name in s), None)
    if first is not None and isinstance(part, JsonlLineSource) and first.blocks < len(part):
      part = part.grown_from(first.blocks)
    parts.append(part)
  return ConcatSource(parts, names=[d.name for d in g.datasets],
                      roots=[dataset_roots(d) for d in g.datasets])


def _kept_blocks(where: str, source, saved: Manifest) -> list[tuple[int, int]]:
  """The blocks of one dataset's `source` that make up its `saved` records."""
  if isinstance(source, JsonlLineSource):
    (name, size), = saved.files
    lines = saved.blocks
    ends = (source.line_offset(lines) if lines < source.num_blocks()
            else fs.file_info(source.path).size)
    if lines > source.num_blocks() or ends != size or (
        saved.tail is not None and tail_digest(source.path, size) != saved.tail):
      raise StateMismatchError(f"{where}: {name} changed in its first {lines} lines (or its "
                               f"first {size} bytes), not only grew: rewritten, not appended. "
                               "A run continues only over the records it started with")
    return [(0, lines)]
  if isinstance(source, ParquetRowSource):
    files = dict(saved.files)
    out, first = [], 0
    for path, blocks in source.file_blocks():
      if posixpath.basename(path) in files:
        out.append((first, first + blocks))
      first += blocks
    return out
  raise StateMismatchError(f"{where}: records were appended to a dataset of "
                           f"{type(source).__name__}, which cannot continue across them: "
                           "start a new stream (without the state) to take them in")


def prepared_samples(cfg: PipelineConfig, group: int, tokenizer, records: ShuffledRecords, *,
                     seed: int, shard: int = 0, readers: int = 1) -> grain.MapDataset:
  """The records through the group's family transform and the sample layout; `seed`
  (and, with `logical_shards` set, the shard) makes every random choice. Records and
  their files are read ahead; `readers` (the shards a process serves) share out the
  process's read-ahead threads and bytes."""
  geometry = Geometry(cfg.vit_patch_size, cfg.vae_image_downsample, cfg.max_num_patch_per_side,
                      cfg.max_latent_size, cfg.interpolate_pos)
  key_shard = rng_shard(cfg, shard)
  prepare = PrepareSample(seed, geometry, tokenizer.special, cfg.text_cond_dropout_prob,
                          cfg.vit_cond_dropout_prob, cfg.vae_cond_dropout_prob, shard=key_shard)
  family = family_transform(cfg, group, tokenizer)
  family.read_ahead = readahead.ReadAhead(
      threads=max(1, readahead.THREADS // readers), max_bytes=readahead.MAX_BYTES // readers,
      storage=storage.policy_for(cfg.storage_timeout_s, cfg.element_timeout_s))
  ahead = readahead.ReadAheadRecords(records, files_of=family.files_ahead,
                                     read_file=functools.partial(fs.read_file,
                                                                 max_bytes=cfg.max_image_bytes),
                                     ahead=family.read_ahead,
                                     depth=max(2, readahead.DEPTH // readers))
  return ahead.random_map(family, seed=family_seed(seed, group, key_shard)).map(prepare)


def group_dataset(cfg: PipelineConfig, group: int, tokenizer, *, seed: int,
                  order_seed: int | None = None, shard: int = 0,
                  shard_count: int = 1) -> grain.MapDataset:
  """One group's prepared samples in one logical shard, element i = the key (group, i).

  `order_seed` (default `seed`) orders the records; `seed` makes every random choice.
  """
  records = group_records(cfg, group, seed=seed if order_seed is None else order_seed,
                          shard=shard, shard_count=shard_count)
  return prepared_samples(cfg, group, tokenizer, records, seed=seed, shard=shard)


def capacities(cfg: PipelineConfig) -> Capacities:
  """Row capacities: the config's where set, else derived (see `default_capacities`)."""
  d = cfg.vae_image_downsample
  vae = [g.vae_transform for g in cfg.groups if g.vae_transform]
  min_tokens = min(((t.min_image_size // d) ** 2 for t in vae), default=1)
  caps = default_capacities(cfg.max_num_tokens, cfg.vae_image_size or d, d, min_tokens,
                            cfg.vit_patch_size)
  overrides = {name: value for name, value in (
      ("vit_patches", cfg.vit_patch_capacity), ("vae_tokens", cfg.vae_token_capacity),
      ("vae_images", cfg.vae_image_capacity), ("splits", cfg.split_capacity))
               if value is not None}
  return dataclasses.replace(caps, **overrides)


def fingerprint(cfg: PipelineConfig, tokenizer, *, seed: int, shard_count: int,
                manifests: Mapping[str, Mapping[str, Manifest]] | None = None) -> dict[str, Any]:
  """What shapes the stream, field by field; a restore under a different one is refused,
  naming each field that changed. Fields that never change a row
  (`config.STREAM_NEUTRAL_FIELDS`) are left out. A group is its weight, whether it is
  mandatory, its datasets' names and counts, and one short hash of the rest; where
  the data lives is not in it (the same data in a bucket is the same stream), what
  it holds is: `data`, each dataset's manifest summary.

  The process index and count are not in it: with `logical_shards` set, a state
  restores under any process count (docs/elastic.md).
  """
  groups = {g.name: _group_fingerprint(g) for g in cfg.groups}
  data = {group: {name: m.summary() for name, m in datasets.items()}
          for group, datasets in (manifests or {}).items()}
  return {"config": {**_shaping(cfg), "groups": groups}, "tokenizer": tokenizer.fingerprint(),
          "seed": int(seed), "logical_shards": int(shard_count), "data": data}


def _shaping(cfg: PipelineConfig) -> dict[str, Any]:
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
          if f.name not in STREAM_NEUTRAL_FIELDS and f.name != "groups"}


def _group_fingerprint(group: GroupConfig) -> dict[str, Any]:
  rest = {k: v for k, v in _group_fields(group).items()
          if k not in ("name", "weight", "is_mandatory", "datasets")}
  return {"weight": group.weight, "is_mandatory": group.is_mandatory,
          "datasets": [[d.name, d.num_used_data, str(group.family.record_format(d))]
                       for d in group.datasets],
          "options": _short_hash(rest)}


def legacy_fingerprint(cfg: PipelineConfig, tokenizer, *, seed: int,
                       shard_count: int) -> dict[str, Any]:
  """The fingerprint state versions 1 and 2 wrote: each group one hash of its config (paths
  included), no data."""
  groups = {g.name: _short_hash(_group_fields(g)) for g in cfg.groups}
  return {"config": {**_shaping(cfg), "groups": groups}, "tokenizer": tokenizer.fingerprint(),
          "seed": int(seed), "logical_shards": int(shard_count)}


def _group_fields(group: GroupConfig) -> dict[str, Any]:
  """A group's config as its fingerprint hashes it: its options as its family's say."""
  fields = dataclasses.asdict(group)
  del fields["options"]
  for dataset in fields["datasets"]:
    del dataset["num_records"]  # a check on read, newer than the hashes of states 1 and 2
  return {**fields, **group.options.fingerprint()}


def _config_defaults() -> dict[str, Any]:
  """Each shaping config field's default, as a fingerprint key: what a state saved before
  the field existed stands for."""
  return {f"config.{f.name}": f.default for f in dataclasses.fields(PipelineConfig)
          if f.default is not dataclasses.MISSING}


def _each(function, items) -> list:
  """`function` of each item, on threads, results (or the first error) in order: a build's
  requests to an object store overlap instead of queueing (the demo's three groups at
  50 ms a request: 1.0 s one after the other, 0.36 s together)."""
  items = list(items)
  if len(items) < 2:
    return [function(i) for i in items]
  with concurrent.futures.ThreadPoolExecutor(min(len(items), io_limits.BUILD_THREADS),
                                             thread_name_prefix="bagel-grain-build") as pool:
    return list(pool.map(function, items))


def stream_identity(cfg: PipelineConfig, tokenizer, *, seed: int, shard_count: int,
                    sources: Sequence[ConcatSource]) -> StreamIdentity:
  """What a saved state must match (see `StreamIdentity`), with each dataset's manifest."""
  parts = [(g, d, part) for g, source in zip(cfg.groups, sources)
           for d, part in zip(g.datasets, source.sources)]
  made = _each(lambda p: dataset_manifest(p[1], p[0].family.record_format(p[1]), p[2]), parts)
  manifests = {g.name: {} for g in cfg.groups}
  for (g, d, _), m in zip(parts, made):
    manifests[g.name][d.name] = m
  return StreamIdentity(
      fingerprint(cfg, tokenizer, seed=seed, shard_count=shard_count, manifests=manifests),
      legacy=legacy_fingerprint(cfg, tokenizer, seed=seed, shard_count=shard_count),
      defaults=_config_defaults(), manifests=manifests)


def _short_hash(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_pipeline(cfg: PipelineConfig, tokenizer, *, seed: int | None = None,
                   process_index: int = 0, process_count: int = 1,
                   batch_size: int | None = None, workers: int | None = None) -> BatchDataset:
  """The Grain dataset of batches: `PackedBatch` dicts of `[batch_size, ...]` numpy arrays.

  The stream is a pure function of (config, tokenizer, seed, process_index,
  process_count); with `logical_shards` set, the stream of each logical shard is
  a pure function of (config, tokenizer, seed), and a state saved under one
  process count restores under another (docs/elastic.md). `workers` (default: the
  config's `num_workers`) only sets how many processes decode ahead. `batch_size`
  defaults to the config's (NeMo's `step_scheduler.local_batch_size`), rows per
  batch of this process.
  """
  # The build's reads (listings, footers, index files) wait out transient failures as a
  # stream's do, within the same deadline.
  with storage.build_scope(storage.policy_for(cfg.storage_timeout_s, cfg.element_timeout_s)):
    return _build_pipeline(cfg, tokenizer, seed=seed, process_index=process_index,
                           process_count=process_count, batch_size=batch_size, workers=workers)


def _build_pipeline(cfg: PipelineConfig, tokenizer, *, seed: int | None, process_index: int,
                    process_count: int, batch_size: int | None,
                    workers: int | None) -> BatchDataset:
  order_seed, seed = stream_seeds(cfg, seed)
  if cfg.allow_truncated_images:
    images.enable_truncated_images()  # process-wide Pillow switch, applied at build time
  count = shard_count(cfg, process_count)
  served = served_shards(cfg, process_index, process_count)
  # One source per group for all served shards: one file index, one row-group cache.
  sources = _each(lambda g: group_source(cfg, g, readers=len(served)), range(len(cfg.groups)))
  caps = capacities(cfg)
  workers = cfg.num_workers if workers is None else workers
  weights = tuple(g.weight for g in cfg.groups)
  mandatory = tuple(g.is_mandatory for g in cfg.groups)
  drops = DropPolicy(max_num_tokens_per_sample=cfg.max_num_tokens_per_sample, capacities=caps,
                     max_consecutive_drops=cfg.max_consecutive_drops,
                     bad_record_window=cfg.bad_record_window, max_bad_ratio=cfg.max_bad_ratio)
  pack = PackSpec(mandatory=mandatory, expected_num_tokens=cfg.expected_num_tokens,
                  max_num_tokens=cfg.max_num_tokens, prefer_buffer_before=cfg.prefer_buffer_before,
                  max_buffer_size=cfg.max_buffer_size, capacities=caps)

  def rows_on(eras: Plan) -> tuple[ShardInterleaveDataset, dict[int, dict[str, list[int]]]]:
    """The served shards' rows with the groups' record sets `eras`, and per shard the
    first epoch of each later set."""
    with storage.build_scope(storage.policy_for(cfg.storage_timeout_s, cfg.element_timeout_s)):
      return _rows_on(eras)

  def _rows_on(eras: Plan):
    grown = {g: grown_source(cfg, g, sources[g], eras[cfg.groups[g].name].sets)
             for g in range(len(cfg.groups)) if cfg.groups[g].name in eras}
    sets = {g: [set_blocks(cfg, g, source, m) for m in eras[cfg.groups[g].name].sets]
            for g, source in grown.items()}
    shards, described, resolved = {}, [], {}
    for s in served:
      records = [group_records(
          cfg, g, seed=order_seed, shard=s, shard_count=count, source=grown.get(g, sources[g]),
          sets=sets.get(g, ()), starts=eras[cfg.groups[g].name].starts[s] if g in sets else ())
                 for g in range(len(cfg.groups))]
      resolved[s] = {cfg.groups[g].name: records[g].era_starts() for g in sets}
      described += [(s, r) for r in records]  # in the fetcher's order of the groups
      groups = [prepared_samples(cfg, g, tokenizer, records[g], seed=seed, shard=s,
                                 readers=len(served)) for g in range(len(cfg.groups))]
      mixed = MixDataset(groups, MixSpec(
          group_names=tuple(g.name for g in cfg.groups), weights=weights,
          records_per_epoch=tuple(r.records_per_epoch for r in records), seed=seed,
          process_index=s, drops=drops,  # the weighted draws are keyed by the shard
          later_eras=tuple(r.later_eras() for r in records)))
      shards[s] = PackDataset(mixed, pack)
    # One fetcher (one pool of workers) for all served shards; their read-ahead shares it.
    depths = read_ahead(weights, mandatory, workers / len(served))
    return ShardInterleaveDataset(
        shards, shard_count=count,
        fetcher=functools.partial(Fetcher, workers=workers, depths=depths * len(served),
                                  timeout_s=cfg.element_timeout_s,
                                  describe=functools.partial(_describe, cfg, described,
                                                             len(served) > 1),
                                  names=[g.name for _ in served for g in cfg.groups])), resolved

  return BatchDataset(rows_on({})[0],
                      batch_size=cfg.batch_size if batch_size is None else batch_size,
                      capacities=caps, identity=stream_identity(
                          cfg, tokenizer, seed=seed, shard_count=count, sources=sources),
                      rebuild=rows_on)


def _describe(cfg: PipelineConfig, described: list[tuple[int, ShuffledRecords]],
              name_shard: bool, group: int, index: int) -> str:
  """An element of the fetcher's `group` as errors name it: group, index and record."""
  shard, records = described[group]
  where = f" of logical shard {shard}" if name_shard else ""
  return (f"group {cfg.groups[group % len(cfg.groups)].name!r}{where} element {index} "
          f"(record {records.record_id(index)})")


def pipeline_stats(iterator: BatchIterator) -> dict[str, Any]:
  """The packer's counters (drawn, packed, dropped by reason, epochs) of a running pipeline,
  summed over the logical shards the process serves (a group's epoch: its shards' lowest).

  Takes the iterator of `build_pipeline`'s dataset (`iterator.stats()`, plus `storage`:
  this process's retries and seconds waited on failing storage per group, see
  `bagel_grain.storage`).
  """
  if not isinstance(iterator, BatchIterator):
    raise TypeError(f"pipeline_stats takes the iterator of build_pipeline's dataset, not a "
                    f"{type(iterator).__name__}: keep that iterator (transformations on top "
                    "make new ones) and call its stats()")
  return {**iterator.stats(), "storage": storage.COUNTS.to_json()}
