"""A real resize on localhost: 2 JAX processes save model state + data iterator through
`bagel_grain.jax` checkpointing mid-epoch; 1 process, then 3 processes restore it and
finish the epoch. Every record is packed exactly once, before plus after."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import grain
import pytest
from etils import epath

from bagel_grain import build_pipeline, load_config, load_tokenizer
from bagel_grain.errors import StateMismatchError
from bagel_grain.jax.checkpoint import ShardStatesHandler, ShardStatesRestore, ShardStatesSave
from jax_cluster import run_processes, small_demo_config

WORKER = Path(__file__).resolve().parent / "elastic_worker.py"
SHARDS = 6
STOP = 2  # batches each saving process packs before the checkpoint


def results(out: Path, mode: str, processes: int) -> list[dict]:
  return [json.loads((out / f"{mode}_{processes}_{i}.json").read_text())
          for i in range(processes)]


def record_keys(result: dict) -> list[tuple]:
  """(group, record id, epoch) of every sample the process packed."""
  return [(k[0], k[3], k[2]) for k in result["keys"]]


@pytest.fixture(scope="module")
def resized(demo_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("elastic")
  config = small_demo_config(demo_dir, out / "config.yaml", num_epochs=1,
                             logical_shards=SHARDS)
  run_processes(WORKER, 2, [config, out, "save", STOP])
  run_processes(WORKER, 1, [config, out, "restore", 0])
  run_processes(WORKER, 3, [config, out, "restore", 0])
  cfg = load_config(config)
  it = iter(build_pipeline(cfg, load_tokenizer(cfg.tokenizer_path), workers=0))
  try:
    uninterrupted = [(k[0], k[3], k[2]) for b in it for row in b["sample_keys"] for k in row]
  finally:
    it.close()
  return out, uninterrupted


def test_two_processes_write_one_file_per_logical_shard(resized):
  out, _ = resized
  for r in results(out, "save", 2):
    assert [f for f in r["files"] if f.startswith("shard_state_")] == sorted(
        f"shard_state_{s}-of-{SHARDS}.json" for s in range(SHARDS))
    assert "data_manifest.json" in r["files"]  # process 0's


@pytest.mark.parametrize("processes", [1, 3])
def test_restored_processes_pack_every_record_once(resized, processes):
  out, uninterrupted = resized
  before = [k for r in results(out, "save", 2) for k in record_keys(r)]
  after = [k for r in results(out, "restore", processes) for k in record_keys(r)]
  assert before and after
  assert not [k for k, n in collections.Counter(before + after).items() if n > 1]
  assert sorted(before + after) == sorted(uninterrupted)
  drawn = collections.Counter()
  for r in results(out, "restore", processes):
    drawn.update({g: c["drawn"] for g, c in r["stats"]["counts"].items()})
  assert drawn == {"t2i_pretrain": 76, "unified_edit": 30, "vlm_sft": 60}  # the whole epoch


@pytest.mark.parametrize("processes", [1, 3])
def test_model_state_comes_back_resharded(resized, processes):
  out, _ = resized
  restored = {}
  for r in results(out, "restore", processes):
    assert r["step"] == 1
    restored.update({int(start): w for start, w in r["w"].items()})
  values = [x for start in sorted(restored) for x in restored[start]]
  assert values == list(range(12))


# --- the checkpoint layout, with simulated processes in this test process ----------------


def test_shard_files_restore_under_another_process_count(demo_config, demo_tokenizer,
                                                         tmp_path):
  cfg = dataclasses.replace(demo_config, logical_shards=4, num_epochs=1)
  handler, directory = ShardStatesHandler(), epath.Path(tmp_path)
  saved = {}
  for p in range(2):
    it = iter(build_pipeline(cfg, demo_tokenizer, process_index=p, process_count=2, workers=0))
    next(it)
    handler.save(directory, args=ShardStatesSave(it))
    saved.update(it.get_state()["shards"])
    it.close()
  assert sorted(f.name for f in directory.iterdir() if f.name.startswith("shard_state_")) == [
      f"shard_state_{s}-of-4.json" for s in range(4)]
  for p in range(3):  # each process reads the files of the shards it serves now
    it = iter(build_pipeline(cfg, demo_tokenizer, process_index=p, process_count=3, workers=0))
    handler.restore(directory, args=ShardStatesRestore(it))
    assert it.get_state()["shards"] == {s: saved[s] for s in map(str, range(p, 4, 3))}
    it.close()
  other = iter(build_pipeline(dataclasses.replace(cfg, logical_shards=8), demo_tokenizer,
                              workers=0))
  with pytest.raises(StateMismatchError, match=r"logical_shards: saved \[4\], now 8"):
    handler.restore(directory, args=ShardStatesRestore(other))
  other.close()


def test_other_iterators_keep_grains_file_per_process(tmp_path):
  it = iter(grain.MapDataset.range(5).to_iter_dataset())
  next(it)
  handler = ShardStatesHandler()
  handler.save(epath.Path(tmp_path), args=ShardStatesSave(it))
  assert [f.name for f in epath.Path(tmp_path).iterdir()] == ["process_0-of-1.json"]
  fresh = iter(grain.MapDataset.range(5).to_iter_dataset())
  handler.restore(epath.Path(tmp_path), args=ShardStatesRestore(fresh))
  assert next(fresh) == 1
