"""Real JAX processes on localhost for the multi-process tests: a small config, a port,
and a launcher that never leaves a process behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def small_demo_config(demo_dir: Path, path: Path, **fields) -> Path:
  """The shipped demo.yaml on `demo_dir`, with a 512-token row, images capped at 128 px
  and `fields` set at the top level."""
  raw = yaml.safe_load((ROOT / "bagel_grain" / "configs" / "demo.yaml").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  raw.update(max_num_tokens=512, expected_num_tokens=384, max_num_tokens_per_sample=384,
             prefer_buffer_before=192, **fields)
  for group in raw["grouped_datasets"].values():
    for key in ("image_transform_args", "vit_image_transform_args"):
      if key in group:
        group[key]["max_image_size"] = min(group[key]["max_image_size"], 128)
        group[key]["min_image_size"] = min(group[key]["min_image_size"], 64)
  path.write_text(yaml.safe_dump(raw))
  return path


# A guard against a hang, not a speed bound: on 2 loaded cores (load 15) one run of 3
# processes restoring a checkpoint took 130 s.
PROCESS_TIMEOUT_S = 300


def run_processes(worker: Path, num_processes: int, args: Sequence[str], *,
                  timeout_s: float = PROCESS_TIMEOUT_S) -> None:
  """Runs `worker PROCESS_ID NUM_PROCESSES PORT *args` as one localhost JAX cluster of
  2 CPU devices per process; fails the test with the log of a process that failed."""
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  procs = [subprocess.Popen(
      [sys.executable, str(worker), str(i), str(num_processes), str(port), *map(str, args)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  logs = []
  try:
    for p in procs:  # one deadline per process; a dead peer cannot stall the run
      logs.append(p.communicate(timeout=timeout_s)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"{worker.name}: {num_processes} processes did not finish in {timeout_s} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, (
        f"{worker.name}: process {i} of {num_processes} failed:\n{log[-4000:]}")


def join_cluster(process_id: int, num_processes: int, port: int, config: str):
  """In a worker process: joins the localhost cluster (gloo collectives between CPU
  devices) and returns the config, its tokenizer and a 1-D `data` mesh of all devices."""
  # pylint: disable=import-outside-toplevel
  import jax
  from jax.sharding import AxisType

  import bagel_grain
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=60)
  cfg = bagel_grain.load_config(config)
  tokenizer = bagel_grain.load_tokenizer(cfg.tokenizer_path)
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  return cfg, tokenizer, mesh
