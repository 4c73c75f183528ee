"""One JAX process of tests/test_ledger.py (not a test module itself).

    python ledger_worker.py PROCESS_ID NUM_PROCESSES PORT CONFIG_YAML OUT_DIR NAME FROM STOP
        [allow_changes]

Trains (takes batches from `bagel_grain.jax.device_iterator` with a ledger) from a
fresh stream (FROM -1) or from checkpoint step FROM, saving at every tenth data step,
until STOP batches were taken. A STOP between two saves is a kill: the process ends
without saving or closing anything. Writes the sample keys of every step it took to
OUT_DIR/<NAME>_<PROCESS_ID>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

EVERY = 10


def main(process_id: int, num_processes: int, port: int, config: str, out_dir: str, name: str,
         start: int, stop: int, allow_changes: bool) -> None:
  from jax_cluster import join_cluster  # pylint: disable=import-outside-toplevel
  cfg, tokenizer, mesh = join_cluster(process_id, num_processes, port, config)
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  import bagel_grain
  from bagel_grain import jax as bgj

  host = iter(bagel_grain.build_pipeline(cfg, tokenizer, batch_size=jax.local_device_count(),
                                        process_index=jax.process_index(),
                                        process_count=jax.process_count(), workers=0))
  ckpt = Path(out_dir) / "ckpt"
  data = bgj.device_iterator(host, mesh, ledger=ckpt / "data_ledger")
  manager = bgj.checkpoint_manager(str(ckpt))
  whole = NamedSharding(mesh, PartitionSpec())

  def state(step):
    return {"step": jax.device_put(jnp.asarray(step), whole)}

  if start >= 0:
    template = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)}
    bgj.restore(manager, start, template, data, allow_changes=allow_changes)
  taken = {}
  while data.batches_taken < stop:
    step = data.batches_taken
    taken[step] = [list(map(list, row)) for row in next(data).sample_keys]
    if data.batches_taken % EVERY == 0:
      bgj.save(manager, data.batches_taken, state(data.batches_taken), data)
  (Path(out_dir) / f"{name}_{process_id}.json").write_text(json.dumps(taken))
  if stop % EVERY:  # killed between two saves: nothing more is written
    sys.stdout.flush()
    os._exit(0)
  data.close()
  manager.close()
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
       sys.argv[6], int(sys.argv[7]), int(sys.argv[8]), "allow_changes" in sys.argv[9:])
