"""One JAX process of tests/test_jax_multiprocess.py (not a test module itself).

    python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT CONFIG_YAML OUT_DIR

Joins a localhost JAX cluster, builds this process's share of the pipeline,
assembles global batches, checkpoints model state + iterator with Orbax, reads
3 more batches, then restores a fresh pipeline from the checkpoint and reads 3
batches again. Writes what it saw to OUT_DIR/process_<id>.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def main(process_id: int, num_processes: int, port: int, config: str, out_dir: str) -> None:
  from jax_cluster import join_cluster  # pylint: disable=import-outside-toplevel
  cfg, tokenizer, mesh = join_cluster(process_id, num_processes, port, config)
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from bagel_grain import jax as bgj
  from bagel_grain.pipeline import build_pipeline

  batch_size = 2

  def data():
    ds = build_pipeline(cfg, tokenizer, batch_size=batch_size,
                        process_index=jax.process_index(), process_count=jax.process_count(),
                        workers=0)
    return bgj.device_iterator(ds, mesh)

  # A reduction over the global array: runs across both processes (gloo collectives).
  global_sum = jax.jit(lambda a: jnp.sum(a.astype(jnp.int32)),
                       out_shardings=NamedSharding(mesh, PartitionSpec()))

  def record(batch):
    local = np.concatenate([np.asarray(s.data).reshape(-1)
                            for s in sorted(batch.arrays["text_ids"].addressable_shards,
                                            key=lambda s: s.index[0].start)])
    return {
        "keys": [[list(k) for k in row] for row in batch.sample_keys],
        "local_checksum": hashlib.sha256(local.tobytes()).hexdigest()[:16],
        "global_text_sum": int(global_sum(batch.arrays["text_ids"])),
        "global_shape": list(batch.arrays["text_ids"].shape),
    }

  sharded = NamedSharding(mesh, PartitionSpec("data"))
  state = {"w": jax.make_array_from_process_local_data(
      sharded, np.arange(4, dtype=np.float32) + 10 * process_id),
           "step": jax.device_put(jnp.asarray(1), NamedSharding(mesh, PartitionSpec()))}
  manager = bgj.checkpoint_manager(str(Path(out_dir) / "ckpt"))

  it = data()
  first = record(next(it))
  bgj.save(manager, 1, state, it)
  after_save = [record(next(it)) for _ in range(3)]
  it.close()

  it = data()
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  restored = bgj.restore(manager, 1, template, it)
  after_restore = [record(next(it)) for _ in range(3)]
  it.close()
  manager.close()

  out = {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "devices": jax.device_count(),
      "local_devices": jax.local_device_count(),
      "first": first,
      "after_save": after_save,
      "after_restore": after_restore,
      "restored_w_local": [float(x) for s in restored["w"].addressable_shards
                           for x in np.asarray(s.data)],
      "saved_w_local": [float(x) for s in state["w"].addressable_shards
                        for x in np.asarray(s.data)],
      "restored_step": int(restored["step"]),
      "state_files": sorted(p.name for p in (Path(out_dir) / "ckpt" / "1" / "data").iterdir()),
  }
  (Path(out_dir) / f"process_{process_id}.json").write_text(json.dumps(out))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
