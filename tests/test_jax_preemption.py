"""A preempted run: SIGTERM sets a flag, the loop saves at the next step boundary after the
asynchronous save in flight, and a restore continues exactly (docs/elastic.md)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp

from bagel_grain import build_pipeline
from bagel_grain.jax import checkpoint_manager, restore
from resume import assert_same_elements, take

WORKER = Path(__file__).resolve().parent / "preempted_worker.py"
STEPS_BEFORE_SIGNAL = 4


def test_sigterm_saves_at_the_next_step_and_restores_exactly(demo_dir, demo_config,
                                                             demo_tokenizer, tmp_path):
  ckpt = tmp_path / "ckpt"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
  with subprocess.Popen([sys.executable, str(WORKER), str(demo_dir), str(ckpt)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=env) as worker:
    try:
      for line in worker.stdout:
        if line.strip() == f"step {STEPS_BEFORE_SIGNAL}":
          worker.send_signal(signal.SIGTERM)  # an asynchronous save is under way
          break
      out, err = worker.communicate(timeout=240)
    finally:
      if worker.poll() is None:
        worker.kill()
  assert worker.returncode == 0, err
  assert "Finalize thread failed" not in err and "Traceback" not in err, err
  preempted_at = int(out.split("preempted at ")[1].split()[0])
  assert preempted_at > STEPS_BEFORE_SIGNAL

  manager = checkpoint_manager(str(ckpt))
  assert manager.latest_step() == preempted_at
  with iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)) as it:
    state = restore(manager, None, {"w": jnp.zeros(4)}, it)
    resumed = take(it, 3)
  with iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)) as it:
    seen = take(it, preempted_at)
    uninterrupted = take(it, 3)
  assert_same_elements(resumed, uninterrupted)
  assert float(state["w"][0]) == sum(float(b["num_tokens"].sum()) for b in seen)
  manager.close()
