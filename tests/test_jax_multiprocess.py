"""Two real JAX processes on localhost: disjoint shards, one global batch, and an Orbax
checkpoint of model state + iterators that both processes resume from identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_cluster import run_processes, small_demo_config

WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"
NUM_PROCESSES = 2


@pytest.fixture(scope="module")
def worker_results(demo_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("multiprocess")
  config = small_demo_config(demo_dir, out / "config.yaml")
  run_processes(WORKER, NUM_PROCESSES, [config, out])
  return [json.loads((out / f"process_{i}.json").read_text()) for i in range(NUM_PROCESSES)]


def records(result):
  """(group, record id) of every sample the process packed."""
  batches = [result["first"], *result["after_save"], *result["after_restore"]]
  return {(k[0], k[3]) for b in batches for row in b["keys"] for k in row}


def test_processes_read_disjoint_shards(worker_results):
  p0, p1 = worker_results
  assert (p0["process_index"], p1["process_index"]) == (0, 1)
  assert p0["process_count"] == p1["process_count"] == NUM_PROCESSES
  assert records(p0) and records(p1)
  assert not records(p0) & records(p1)


def test_one_global_batch_spans_both_processes(worker_results):
  for r in worker_results:
    assert r["devices"] == 4 and r["local_devices"] == 2
    assert r["first"]["global_shape"][0] == NUM_PROCESSES * len(r["first"]["keys"]) == 4
  p0, p1 = worker_results
  # The jitted sum over the global array saw both processes' rows.
  assert p0["first"]["global_text_sum"] == p1["first"]["global_text_sum"]
  assert p0["first"]["local_checksum"] != p1["first"]["local_checksum"]


def test_both_processes_resume_identically_after_restore(worker_results):
  for r in worker_results:
    assert r["after_restore"] == r["after_save"]
    assert r["restored_w_local"] == r["saved_w_local"] and r["restored_step"] == 1
    assert [f for f in r["state_files"] if f.endswith(".json")] == [
        "data_manifest.json",  # process 0's: the files each dataset held
        "shard_state_0-of-2.json", "shard_state_1-of-2.json"]  # one JSON per logical shard
  # ... and the resumed batches are new ones, not the batch before the checkpoint.
  assert worker_results[0]["after_save"][0]["keys"] != worker_results[0]["first"]["keys"]
