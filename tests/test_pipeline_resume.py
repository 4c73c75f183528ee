"""The whole pipeline on the demo data: resume, determinism, sharding, refusals."""

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from bagel_grain import build_pipeline, pipeline_stats
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.pipeline import fingerprint, legacy_fingerprint
from bagel_grain.errors import GroupExhaustedError, StateMismatchError
from bagel_grain.workers import Fetcher
from resume import assert_resumes_identically, assert_same_elements, take


def pipeline(cfg, tokenizer, **kwargs):
  """A maker of pipeline iterators, one row per batch unless told."""
  return lambda: iter(build_pipeline(cfg, tokenizer, **{"batch_size": 1, "workers": 0,
                                                         **kwargs}))


@pytest.fixture(scope="module")
def reference(demo_config, demo_tokenizer):
  """The uninterrupted run: 30 batches of one row, in-process decoding."""
  with pipeline(demo_config, demo_tokenizer)() as it:
    return take(it, 30)


def test_resume_continues_bit_identically(demo_config, demo_tokenizer, reference):
  run = assert_resumes_identically(pipeline(demo_config, demo_tokenizer), steps=30,
                                   at=[0, 3, 9, 29], max_state_bytes=16 * 1024)
  assert_same_elements(run, reference)


def test_resume_across_worker_counts(demo_config, demo_tokenizer, reference):
  # Saved under 2 worker processes, restored in-process, and the other way round:
  # the stream does not depend on the worker count.
  in_process, two_workers = (pipeline(demo_config, demo_tokenizer, workers=w) for w in (0, 2))
  run = assert_resumes_identically(two_workers, steps=12, at=[5], make_restored=in_process)
  assert_same_elements(run, reference[:12])
  assert_resumes_identically(in_process, steps=12, at=[6], make_restored=two_workers)


def test_same_seed_same_stream_other_seed_other_stream(demo_config, demo_tokenizer, reference):
  with pipeline(demo_config, demo_tokenizer)() as it:
    assert_same_elements(take(it, 5), reference[:5])
  with pipeline(demo_config, demo_tokenizer, seed=7)() as other:
    assert [b["sample_keys"] for b in take(other, 5)] != [
        b["sample_keys"] for b in reference[:5]]


def test_processes_read_disjoint_records(demo_config, demo_tokenizer):
  seen = []
  for p in range(2):
    it = iter(build_pipeline(demo_config, demo_tokenizer, batch_size=2, process_index=p,
                             process_count=2, workers=0))
    records = {k[3] for b in take(it, 6) for keys in b["sample_keys"] for k in keys}
    seen.append(records)
    assert stats_add_up(pipeline_stats(it))
  assert seen[0] and seen[1] and not seen[0] & seen[1]


def stats_add_up(stats):
  return stats["drawn"] == (stats["packed"] + stats["dropped"] + stats["buffered"]
                            + stats["carried"])


def test_restore_under_another_config_or_layout_is_refused(demo_config, demo_tokenizer):
  it = iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0))
  take(it, 2)
  state = it.get_state()
  changed = dataclasses.replace(demo_config, max_buffer_size=3)
  with pytest.raises(StateMismatchError, match="config"):
    iter(build_pipeline(changed, demo_tokenizer, batch_size=1, workers=0)).set_state(state)
  with pytest.raises(StateMismatchError, match="logical_shards: saved 1, now 2"):
    iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0,
                        process_count=2)).set_state(state)
  with pytest.raises(StateMismatchError, match="seed"):
    iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0,
                        seed=1)).set_state(state)


def test_finite_epochs_yield_each_record_once(demo_config, demo_tokenizer):
  cfg = dataclasses.replace(demo_config, num_epochs=1)
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=4, workers=0))
  batches = list(it)
  stats = pipeline_stats(it)
  keys = [k for b in batches for keys in b["sample_keys"] for k in keys]
  assert len(keys) == len(set(keys)) == stats["packed"]
  assert stats["buffered"] == stats["carried"] == 0
  for name, counts in stats["counts"].items():
    # every record of the epoch was drawn exactly once
    assert counts["drawn"] == {"t2i_pretrain": 76, "unified_edit": 30, "vlm_sft": 60}[name]
  # static shapes even for the padded last batch
  assert all(b["text_ids"].shape == batches[0]["text_ids"].shape for b in batches)


def test_group_of_only_bad_records_fails_naming_it(demo_config, demo_tokenizer, tmp_path):
  vlm = demo_config.group("vlm_sft")
  bad = tmp_path / "bad.jsonl"
  bad.write_text("not json\n" * 50)
  dataset = dataclasses.replace(vlm.datasets[0], jsonl_path=str(bad))
  groups = tuple(dataclasses.replace(g, datasets=(dataset,)) if g.name == "vlm_sft" else g
                 for g in demo_config.groups)
  cfg = dataclasses.replace(demo_config, groups=groups, max_consecutive_drops=40)
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0))
  with pytest.raises(GroupExhaustedError, match=r"'vlm_sft'.*bad_json: 40"):
    next(it)


def _as_saved(record: str, data_dir) -> str:
  """A record id (`demo_t2i/part-00000.parquet#3`) as release 0.1's digests spelled it:
  the file relative to `data_dir` (`t2i/part-00000.parquet#3`)."""
  name, rest = record.split("/", 1)
  info = yaml.safe_load((Path(data_dir) / "dataset_info.yaml").read_text())
  folder = next(d[name]["data_dir"] for d in info.values() if name in d)
  return f"{folder}/{rest}"


def batch_sha256(batch, data_dir) -> str:
  """One digest of a batch: every array (name, dtype, shape, bytes) and its sample keys,
  their record ids relative to `data_dir`."""
  h = hashlib.sha256()
  for name in sorted(batch):
    value = batch[name]
    if name == "sample_keys":
      keys = [[[*k[:3], _as_saved(k[3], data_dir)] for k in row] for row in value]
      h.update(json.dumps(keys).encode())
    else:
      h.update(name.encode())
      h.update(str(value.dtype).encode())
      h.update(str(value.shape).encode())
      h.update(np.ascontiguousarray(value).tobytes())
  return h.hexdigest()


def test_state_saved_by_release_0_1_restores_to_the_same_batches(demo_config, demo_tokenizer,
                                                                     demo_dir):
  # tests/data/demo_state_v1.json was written by bagel_grain 0.1.0 (see tests/data/README.md):
  # a checkpoint of an earlier release must keep restoring to the same stream.
  saved = json.loads((Path(__file__).parent / "data" / "demo_state_v1.json").read_text())
  state = saved["state"]
  it = iter(build_pipeline(demo_config, demo_tokenizer, batch_size=saved["batch_size"],
                           workers=0))
  try:
    # The config hash covers the demo data's absolute paths, which differ per test run;
    # everything else that shapes the stream must match as saved (0.1.0 named the process,
    # 0 of 1, where logical shard 0 of 1 stands now).
    ours = legacy_fingerprint(demo_config, demo_tokenizer, seed=demo_config.data_seed,
                              shard_count=1)
    assert {k: v for k, v in state["fingerprint"].items() if k != "config"} == {
        "tokenizer": ours["tokenizer"], "seed": ours["seed"], "process_index": 0,
        "process_count": ours["logical_shards"]}
    it.set_state({**state, "fingerprint": {**state["fingerprint"], "config": ours["config"]}})
    assert [batch_sha256(next(it), demo_dir) for _ in saved["next_batch_sha256"]] == \
        saved["next_batch_sha256"]
  finally:
    it.close()


@pytest.mark.parametrize("case", [0, 1], ids=["one_shard", "logical_shards_4"])
def test_state_saved_by_version_2_restores_to_the_same_batches(demo_config, demo_tokenizer,
                                                                demo_dir, case):
  # tests/data/demo_state_v2.json was written by commit 78e9849 (state version 2, before
  # states had a fixed structure; see tests/data/README.md).
  saved = json.loads((Path(__file__).parent / "data" / "demo_state_v2.json").read_text())[case]
  state = saved["state"]
  assert state["version"] == 2
  cfg = dataclasses.replace(demo_config, logical_shards=saved["logical_shards"])
  with iter(build_pipeline(cfg, demo_tokenizer, batch_size=saved["batch_size"],
                           workers=0)) as it:
    # Version 2 hashed each group whole, the demo data's absolute paths (which differ per
    # test run) included: the rest must match as saved.
    ours = legacy_fingerprint(cfg, demo_tokenizer, seed=cfg.data_seed,
                              shard_count=saved["logical_shards"] or 1)
    assert {**state["fingerprint"], "config": None} == {**ours, "config": None}
    it.set_state({**state, "fingerprint": {**state["fingerprint"], "config": ours["config"]}})
    assert [batch_sha256(next(it), demo_dir) for _ in saved["next_batch_sha256"]] == \
        saved["next_batch_sha256"]


# What a version-3 state holds for each demo group's options (`fingerprint`'s "options"),
# as commit d4664b9 saved them, before families declared their own group options; the
# VLM group's with `sample: middle` besides.
SAVED_GROUP_OPTIONS = {"t2i_pretrain": "395935b2cc0c530c", "unified_edit": "0f8c40ba4d86e444",
                       "vlm_sft": "6ca9bba3a744d625"}
SAVED_VLM_MIDDLE_OPTIONS = "2b88dbbe7db7f164"


def test_group_options_hash_as_version_3_states_hold_them(demo_config, demo_tokenizer):
  def options(cfg):
    groups = fingerprint(cfg, demo_tokenizer, seed=42, shard_count=1)["config"]["groups"]
    return {name: group["options"] for name, group in groups.items()}

  assert options(demo_config) == SAVED_GROUP_OPTIONS
  vlm = demo_config.group("vlm_sft")
  middle = dataclasses.replace(vlm, options=dataclasses.replace(
      vlm.options, frame_sampler=FrameSamplerArgs(6, 4, "middle")))
  assert options(dataclasses.replace(demo_config, groups=(*demo_config.groups[:2], middle))) \
      == {**SAVED_GROUP_OPTIONS, "vlm_sft": SAVED_VLM_MIDDLE_OPTIONS}


def test_pipeline_stats_takes_the_pipelines_own_iterator(demo_config, demo_tokenizer):
  ds = build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)
  with iter(ds) as it:
    next(it)
    stats = pipeline_stats(it)  # the iterator's, and this process's storage counters
    assert stats == {**it.stats(), "storage": stats["storage"]} and it.stats()["rows"] == 1
  mapped = iter(ds.map(lambda batch: batch))
  try:
    with pytest.raises(TypeError, match="keep that iterator"):
      pipeline_stats(mapped)
  finally:
    mapped.close()


# Knobs that never change a row: a state saved under one value restores under another.
STREAM_NEUTRAL = {"num_workers": 3, "max_consecutive_drops": 7, "bad_record_window": 50,
                  "max_bad_ratio": 0.5, "max_image_bytes": 1 << 20,
                  "max_row_group_cache_bytes": 1, "element_timeout_s": 60.0}


def test_knobs_that_do_not_shape_the_stream_keep_a_saved_state_valid(demo_config, demo_tokenizer,
                                                                    reference):
  with pipeline(demo_config, demo_tokenizer)() as it:
    take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
  changed = dataclasses.replace(demo_config, **STREAM_NEUTRAL)
  with pipeline(changed, demo_tokenizer)() as it:
    it.set_state(state)
    assert_same_elements(take(it, 3), reference[5:8])


def test_a_field_that_shapes_the_stream_is_named_when_it_changed(demo_config, demo_tokenizer):
  with pipeline(demo_config, demo_tokenizer)() as it:
    next(it)
    state = it.get_state()
  changed = dataclasses.replace(demo_config, max_buffer_size=3,
                                text_cond_dropout_prob=0.5)
  with pipeline(changed, demo_tokenizer)() as it:
    with pytest.raises(StateMismatchError, match=r"config.max_buffer_size: saved 16, now 3; "
                                                 r"config.text_cond_dropout_prob: saved 0.1, "
                                                 r"now 0.5\)"):
      it.set_state(state)


def test_an_interrupted_next_of_two_logical_shards_loses_nothing(demo_config, demo_tokenizer,
                                                                monkeypatch):
  cfg = dataclasses.replace(demo_config, logical_shards=2)  # both served by this process
  with pipeline(cfg, demo_tokenizer, batch_size=2)() as it:
    want = [b["sample_keys"] for b in take(it, 8)]
  calls, get = [0], Fetcher.get

  def interrupting(self, group, index):
    calls[0] += 1
    if calls[0] in (3, 11, 12, 20, 34, 50, 77):  # at different points of different batches
      raise KeyboardInterrupt
    return get(self, group, index)

  monkeypatch.setattr(Fetcher, "get", interrupting)
  got = []
  with pipeline(cfg, demo_tokenizer, batch_size=2)() as it:
    while len(got) < len(want):
      before = it.get_state()
      try:
        got.append(next(it)["sample_keys"])
      except KeyboardInterrupt:
        assert it.get_state() == before
  assert got == want and calls[0] > 77
