"""A training loop preempted by SIGTERM (not a test module; tests/test_jax_preemption.py).

    python preempted_worker.py DATA_DIR CKPT_DIR

Trains on the demo config, saving every step without waiting (`wait=False`), so
that an asynchronous save is finishing when the signal comes; prints `step N` after
each step. On SIGTERM the handler only sets a flag; the loop saves at the next step
boundary, after the save in flight (docs/elastic.md, "Saving on preemption"), prints
`preempted at N` and exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading


def main(data_dir: str, ckpt_dir: str) -> None:
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp

  from bagel_grain import build_pipeline
  from bagel_grain import jax as bgj
  from bagel_grain.configs import load_shipped
  from bagel_grain.tokenizer import load_tokenizer

  preempted = threading.Event()
  signal.signal(signal.SIGTERM, lambda signum, frame: preempted.set())

  cfg = load_shipped("demo", data_dir)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  manager = bgj.checkpoint_manager(ckpt_dir)
  state = {"w": jnp.zeros(4)}
  with iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=0)) as data:
    for step in range(1, 10_000):
      batch = next(data)
      state = {"w": state["w"] + batch["num_tokens"].sum()}  # the training step
      if preempted.is_set():  # at a step boundary, never inside the handler
        manager.wait_until_finished()  # the asynchronous save in flight ends first
        bgj.save(manager, step, state, data)  # waits for its own writes
        print(f"preempted at {step}", flush=True)
        break
      bgj.save(manager, step, state, data, wait=False)
      print(f"step {step}", flush=True)
  manager.close()


if __name__ == "__main__":
  main(*sys.argv[1:])
