"""Two real JAX processes on localhost: disjoint shards, one global batch, and an Orbax
checkpoint of model state + iterators that both processes resume from identically."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"
TIMEOUT_S = 120
NUM_PROCESSES = 2


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def small_demo_config(demo_dir: Path, path: Path) -> Path:
  """the shipped demo.yaml on `demo_dir`, with a 512-token row and images capped at 128 px."""
  raw = yaml.safe_load((ROOT / "bagel_grain" / "configs" / "demo.yaml").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  raw.update(max_num_tokens=512, expected_num_tokens=384, max_num_tokens_per_sample=384,
             prefer_buffer_before=192)
  for group in raw["grouped_datasets"].values():
    for key in ("image_transform_args", "vit_image_transform_args"):
      if key in group:
        group[key]["max_image_size"] = min(group[key]["max_image_size"], 128)
        group[key]["min_image_size"] = min(group[key]["min_image_size"], 64)
  path.write_text(yaml.safe_dump(raw))
  return path


@pytest.fixture(scope="module")
def worker_results(demo_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("multiprocess")
  config = small_demo_config(demo_dir, out / "config.yaml")
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  procs = [subprocess.Popen(
      [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port), str(config), str(out)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(NUM_PROCESSES)]
  logs = []
  try:
    for p in procs:  # one deadline per process; a dead peer cannot stall the run
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"multi-process workers did not finish in {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
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
        "process_0-of-2.json", "process_1-of-2.json"]  # one JSON per process
  # ... and the resumed batches are new ones, not the batch before the checkpoint.
  assert worker_results[0]["after_save"][0]["keys"] != worker_results[0]["first"]["keys"]
