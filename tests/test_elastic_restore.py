"""Elastic restore: a run on P processes, stopped after any row and resumed on P' processes,
packs every record of the epoch exactly once, each sample bit-identical to an
uninterrupted run's (docs/elastic.md). Processes are simulated: explicit
`process_index` / `process_count` in this one test process."""

import collections
import dataclasses
import hashlib
import json

import numpy as np
import psutil
import pytest

from bagel_grain import build_pipeline, pipeline_stats
from bagel_grain.errors import ConfigError, StateMismatchError
from bagel_grain.packing.shards import merge_states
from bagel_grain.pipeline import group_dataset, legacy_fingerprint

SHARDS = 4
RECORDS = {"t2i_pretrain": 76, "unified_edit": 30, "vlm_sft": 60}  # the demo data's epoch
# (P, P', rows each process packs before the stop); at every stop some shard holds a
# buffered or carried sample (1->2: a carried one), which the restore re-creates by key.
CASES = [(1, 2, 35), (2, 1, 3), (2, 4, 5), (4, 3, 2), (3, 1, 4)]
TOKEN_FIELDS = ("text_ids", "token_type", "position_ids", "label_ids", "ce_weights",
                "timesteps", "mse_mask")


def small_rows(cfg, **changes):
  """The demo config with 1024-token rows and images of at most 128 px: many short rows."""
  groups = []
  for g in cfg.groups:
    capped = {name: dataclasses.replace(t, max_image_size=min(t.max_image_size, 256),
                                        min_image_size=min(t.min_image_size, 128))
              for name in ("image_transform", "vit_image_transform")
              if (t := getattr(g, name)) is not None}
    groups.append(dataclasses.replace(g, **capped))
  return dataclasses.replace(cfg, groups=tuple(groups), max_num_tokens=1024,
                             expected_num_tokens=768, max_num_tokens_per_sample=768,
                             prefer_buffer_before=384, max_buffer_size=2, **changes)


@pytest.fixture(scope="module")
def elastic_config(demo_config):
  return small_rows(demo_config, num_epochs=1, logical_shards=SHARDS)


def sample_contents(batch):
  """Per packed sample, (group, record, epoch) -> a digest of everything packed for it:
  text ids, token types, positions, labels and weights (dropout decisions show as
  missing tokens), timesteps, splits, ViT patches, VAE latent positions and pixels."""
  out = {}
  for b, keys in enumerate(batch["sample_keys"]):
    row = {name: np.asarray(value[b]) for name, value in batch.items() if name != "sample_keys"}
    image_slot = 0
    for segment, key in enumerate(keys, start=1):
      mine = row["segment_ids"] == segment
      positions = np.flatnonzero(mine)
      h = hashlib.sha256()
      for name in TOKEN_FIELDS:
        h.update(row[name][mine].tobytes())
      splits = row["split_ids"][mine]
      h.update((splits - splits.min()).tobytes())
      h.update(row["split_modes"][np.unique(splits) - 1].tobytes())
      vit = np.isin(row["vit_token_index"], positions)
      h.update(row["vit_patches"][vit].tobytes() + row["vit_position_ids"][vit].tobytes())
      vae = np.isin(row["vae_token_index"], positions)
      h.update(row["vae_latent_position_ids"][vae].tobytes())
      latent = row["token_type"][mine] == 3  # one run of latent tokens per VAE image
      images = int(np.sum(latent[1:] & ~latent[:-1]) + latent[0])
      for slot in range(image_slot, image_slot + images):
        height, width = row["vae_image_hw"][slot]
        h.update(row["vae_images"][slot, :height, :width].tobytes())
      image_slot += images
      out[(key[0], key[3], key[2])] = h.hexdigest()
    assert image_slot == int(np.sum(row["vae_image_hw"][:, 0] > 0))  # every image accounted
  return out


def run(cfg, tokenizer, processes, *, rows=None, state=None):
  """Each simulated process packs `rows` rows (None: to the end of the epoch).

  Returns per process: its samples in packing order as ((group, record, epoch),
  digest), its rows, its state (JSON, as a checkpoint holds it) and its stats."""
  samples, counts, states, stats = [], [], [], []
  for p in range(processes):
    samples.append([])
    it = iter(build_pipeline(cfg, tokenizer, batch_size=1, process_index=p,
                             process_count=processes, workers=0))
    try:
      if state is not None:
        it.set_state(state)
      n = 0
      for batch in it:
        samples[p].extend(sample_contents(batch).items())
        n += 1
        if n == rows:
          break
      counts.append(n)
      states.append(json.loads(json.dumps(it.get_state())))
      stats.append(pipeline_stats(it))
    finally:
      it.close()
  return samples, counts, states, stats


@pytest.fixture(scope="module")
def uninterrupted(elastic_config, demo_tokenizer):
  samples, _, _, stats = run(elastic_config, demo_tokenizer, 1)
  assert {g: c["drawn"] for g, c in stats[0]["counts"].items()} == RECORDS
  return dict(samples[0])


@pytest.mark.parametrize("before,after,stop", CASES, ids=[f"{a}->{b}" for a, b, _ in CASES])
def test_resize_packs_every_record_once_and_each_sample_unchanged(
    elastic_config, demo_tokenizer, uninterrupted, before, after, stop):
  first, rows_before, states, held = run(elastic_config, demo_tokenizer, before, rows=stop)
  assert rows_before == [stop] * before  # stopped mid-epoch on every process
  assert sum(s["buffered"] + s["carried"] for s in held) > 0
  rest, rows_after, _, stats = run(elastic_config, demo_tokenizer, after,
                                   state=merge_states(states))
  packed = [sample for process in first + rest for sample in process]
  keys = [key for key, _ in packed]
  assert not [k for k, n in collections.Counter(keys).items() if n > 1]  # none packed twice
  assert set(keys) == set(uninterrupted)  # none lost
  assert dict(packed) == uninterrupted  # each sample bit-identical, by key
  # The counters travel with their shards: over the epoch every record was drawn once.
  drawn = collections.Counter()
  for s in stats:
    drawn.update({g: c["drawn"] for g, c in s["counts"].items()})
  assert drawn == RECORDS
  assert sum(s["packed"] for s in stats) == len(keys)
  print(f"{before}->{after}: rows before {sum(rows_before)}, after {sum(rows_after)}, "
        f"samples packed once {len(keys)} / expected {len(uninterrupted)}")


def test_same_process_count_continues_bit_identically(elastic_config, demo_tokenizer):
  whole, _, _, _ = run(elastic_config, demo_tokenizer, 2, rows=8)
  first, _, states, _ = run(elastic_config, demo_tokenizer, 2, rows=3)
  rest, _, _, _ = run(elastic_config, demo_tokenizer, 2, rows=5, state=merge_states(states))
  assert [a + b for a, b in zip(first, rest)] == whole


def test_state_per_logical_shard_is_at_most_2_kib(elastic_config, demo_tokenizer):
  it = iter(build_pipeline(elastic_config, demo_tokenizer, batch_size=1, workers=0))
  try:
    sizes = []
    for _ in range(12):
      next(it)
      sizes.extend(len(json.dumps(s)) for s in it.get_state()["shards"].values())
  finally:
    it.close()
  assert max(sizes) <= 2048


def test_logical_shards_1_is_the_one_process_stream(demo_config, demo_tokenizer):
  streams = []
  for cfg in (demo_config, dataclasses.replace(demo_config, logical_shards=1)):
    it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=0))
    try:
      streams.append([next(it) for _ in range(4)])
    finally:
      it.close()
  for a, b in zip(*streams):
    assert a["sample_keys"] == b["sample_keys"]
    for name in a:
      if name != "sample_keys":
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def first_timestep(ds, index):
  """The timestep drawn for the first noised VAE image of element `index` (a T2I sample)."""
  layout = ds[index].layout
  return layout.timesteps[np.flatnonzero(layout.mse_mask)[0]]


def test_shards_draw_their_own_random_choices(demo_config, demo_tokenizer):
  t2i = [g.name for g in demo_config.groups].index("t2i_pretrain")
  cfg = dataclasses.replace(demo_config, logical_shards=2)
  shard = [group_dataset(cfg, t2i, demo_tokenizer, seed=42, shard=s, shard_count=2)
           for s in range(2)]
  assert first_timestep(shard[0], 0) != first_timestep(shard[1], 0)
  # Without logical shards, processes keep the draws they had before (one per index).
  process = [group_dataset(demo_config, t2i, demo_tokenizer, seed=42, shard=s, shard_count=2)
             for s in range(2)]
  assert first_timestep(process[0], 0) == first_timestep(process[1], 0)


def test_restore_refuses_another_shard_count_seed_or_missing_shard(elastic_config,
                                                                   demo_tokenizer):
  _, _, states, _ = run(elastic_config, demo_tokenizer, 2, rows=1)
  other = dataclasses.replace(elastic_config, logical_shards=SHARDS * 2)
  with pytest.raises(StateMismatchError, match=f"logical_shards: saved {SHARDS}, now 8"):
    iter(build_pipeline(other, demo_tokenizer, workers=0)).set_state(merge_states(states))
  with pytest.raises(StateMismatchError, match="seed"):
    iter(build_pipeline(elastic_config, demo_tokenizer, workers=0, seed=1)).set_state(
        merge_states(states))
  with pytest.raises(StateMismatchError, match=r"no entry for logical shards \[1, 3\]"):
    iter(build_pipeline(elastic_config, demo_tokenizer, workers=0)).set_state(states[0])


def test_more_processes_than_logical_shards_is_a_config_error(elastic_config, demo_tokenizer):
  with pytest.raises(ConfigError, match="logical_shards"):
    build_pipeline(elastic_config, demo_tokenizer, process_index=0, process_count=SHARDS + 1)


def test_a_state_from_before_logical_shards_restores_only_on_its_process(demo_config,
                                                                         demo_tokenizer):
  it = iter(build_pipeline(demo_config, demo_tokenizer, process_index=1, process_count=2,
                           workers=0))
  try:
    next(it)
    state = json.loads(json.dumps(it.get_state()))
  finally:
    it.close()
  # Version 1 (release 0.1.0): one process's packing state, the process in the fingerprint.
  fingerprint = {k: v for k, v in legacy_fingerprint(
      demo_config, demo_tokenizer, seed=demo_config.data_seed, shard_count=2).items()
                 if k != "logical_shards"}
  old = {"version": 1, "fingerprint": {**fingerprint, "process_index": 1, "process_count": 2},
         **state["shards"]["1"]["packer"]}
  same = iter(build_pipeline(demo_config, demo_tokenizer, process_index=1, process_count=2,
                             workers=0))
  same.set_state(old)
  assert same.get_state() == state
  same.close()
  with pytest.raises(StateMismatchError, match=r"no entry for logical shards \[0\]"):
    iter(build_pipeline(demo_config, demo_tokenizer, process_index=0, process_count=2,
                        workers=0)).set_state(old)


def test_shards_share_one_pool_of_workers_and_it_does_not_change_the_stream(elastic_config,
                                                                            demo_tokenizer):
  streams = []
  for workers in (0, 2):
    it = iter(build_pipeline(elastic_config, demo_tokenizer, batch_size=2, workers=workers))
    try:
      streams.append([sample_contents(next(it)) for _ in range(6)])
      if workers:  # four shards, one pool: the workers of this pipeline and no more
        spawned = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(spawned) == workers
    finally:
      it.close()
  assert streams[0] == streams[1]
