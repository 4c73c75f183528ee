"""One JAX process of tests/test_jax_elastic.py (not a test module itself).

    python elastic_worker.py PROCESS_ID NUM_PROCESSES PORT CONFIG_YAML OUT_DIR MODE STOP

MODE `save`: packs STOP batches, then checkpoints model state + iterator at step 1
through `bagel_grain.jax`. MODE `restore`: restores step 1 under this cluster's
process count and packs to the end of the epoch. Writes the sample keys it packed,
its stats and what it restored to OUT_DIR/<MODE>_<NUM_PROCESSES>_<PROCESS_ID>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GLOBAL_W = 12  # model-state length: divisible by the device count of 1, 2 and 3 processes


def main(process_id: int, num_processes: int, port: int, config: str, out_dir: str, mode: str,
         stop: int) -> None:
  from jax_cluster import join_cluster  # pylint: disable=import-outside-toplevel
  cfg, tokenizer, mesh = join_cluster(process_id, num_processes, port, config)
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  import bagel_grain
  from bagel_grain import jax as bgj

  host = iter(bagel_grain.build_pipeline(cfg, tokenizer, batch_size=jax.local_device_count(),
                                        process_index=jax.process_index(),
                                        process_count=jax.process_count(), workers=0))
  data = bgj.device_iterator(host, mesh)
  sharded = NamedSharding(mesh, PartitionSpec("data"))
  manager = bgj.checkpoint_manager(str(Path(out_dir) / "ckpt"))
  keys, out = [], {}
  if mode == "save":
    w = np.arange(GLOBAL_W, dtype=np.float32)
    local = np.split(w, jax.process_count())[jax.process_index()]
    state = {"w": jax.make_array_from_process_local_data(sharded, local),
             "step": jax.device_put(jnp.asarray(1), NamedSharding(mesh, PartitionSpec()))}
    for _ in range(stop):
      keys.extend(next(data).sample_keys)
    bgj.save(manager, 1, state, data)
    out["files"] = sorted(p.name for p in (Path(out_dir) / "ckpt" / "1" / "data").iterdir())
  else:
    template = {"w": jax.ShapeDtypeStruct((GLOBAL_W,), jnp.float32, sharding=sharded),
                "step": jax.ShapeDtypeStruct((), jnp.int32,
                                            sharding=NamedSharding(mesh, PartitionSpec()))}
    restored = bgj.restore(manager, 1, template, data)
    out["w"] = {int(s.index[0].start or 0): np.asarray(s.data).tolist()
                for s in restored["w"].addressable_shards}
    out["step"] = int(restored["step"])
    for batch in data:
      keys.extend(batch.sample_keys)
    out["stats"] = bagel_grain.pipeline_stats(host)  # final: the epoch has ended
  out["keys"] = [list(k) for row in keys for k in row]
  data.close()
  manager.close()
  name = f"{mode}_{num_processes}_{process_id}.json"
  (Path(out_dir) / name).write_text(json.dumps(out))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
       sys.argv[6], int(sys.argv[7]))
