"""Global batches on 8 simulated devices, and the device prefetch thread."""

from __future__ import annotations

import dataclasses
import threading

import grain
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from bagel_grain.jax import global_batch
from bagel_grain.pipeline import build_pipeline


@pytest.fixture(scope="module")
def demo_batch(demo_config, demo_tokenizer):
  cfg = dataclasses.replace(demo_config, expected_num_tokens=768, max_num_tokens=1024,
                            max_num_tokens_per_sample=768, prefer_buffer_before=384)
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=8, workers=0))
  try:
    return next(it)
  finally:
    it.close()


def test_eight_devices_are_simulated():
  assert jax.device_count() == 8


def test_global_batch_is_sharded_over_the_data_axis(demo_batch):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  out = global_batch.make_global_batch(demo_batch, mesh, data_axes="data",
                                       replicated=("split_modes",))
  assert out.sample_keys == list(demo_batch["sample_keys"])
  assert "sample_keys" not in out.arrays
  for name, local in demo_batch.items():
    if name == "sample_keys":
      continue
    arr = out.arrays[name]
    assert arr.shape == local.shape and arr.dtype == local.dtype, name
    assert np.array_equal(np.asarray(arr), local), name
    if name == "split_modes":
      assert arr.sharding.spec == PartitionSpec() and arr.sharding.is_fully_replicated
    else:
      assert arr.sharding.spec == PartitionSpec("data")
      # 4 data shards of 2 rows, each held by the 2 devices of the model axis.
      rows = {(s.index[0].start, s.index[0].stop) for s in arr.addressable_shards}
      assert rows == {(i, i + 2) for i in range(0, 8, 2)}, name


def test_several_data_axes_shard_the_batch_over_their_product(demo_batch):
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"))
  out = global_batch.make_global_batch(demo_batch, mesh, data_axes=("replica", "fsdp"))
  tokens = out.arrays["text_ids"]
  assert tokens.sharding.spec == PartitionSpec(("replica", "fsdp"))
  assert len({s.index[0].start for s in tokens.addressable_shards}) == 8
  assert np.array_equal(np.asarray(tokens), demo_batch["text_ids"])


def numbered(n, fail_at=None):
  """A Grain iterator of batches {"x": [8, 3] filled with i}, raising at `fail_at`."""

  def make(i):
    if i == fail_at:
      raise RuntimeError(f"bad record {i}")
    return {"x": np.full((8, 3), i, np.int32), "sample_keys": [(i,)] * 8}

  return iter(grain.MapDataset.range(n).map(make).to_iter_dataset())


def test_prefetch_yields_the_same_batches_in_order():
  mesh = jax.make_mesh((8,), ("data",))
  it = global_batch.device_iterator(numbered(6), mesh, buffer_size=2)
  got = [b for b in it]
  assert [int(np.asarray(b.arrays["x"])[0, 0]) for b in got] == list(range(6))
  assert all(b.arrays["x"].sharding.spec == PartitionSpec("data") for b in got)
  assert got[3].sample_keys == [(3,)] * 8
  with pytest.raises(StopIteration):
    next(it)
  it.close()


def test_prefetch_reraises_a_producer_error_in_the_consumer():
  mesh = jax.make_mesh((8,), ("data",))
  it = global_batch.device_iterator(numbered(6, fail_at=3), mesh)
  assert [int(np.asarray(next(it).arrays["x"])[0, 0]) for _ in range(3)] == [0, 1, 2]
  with pytest.raises(RuntimeError, match="bad record 3"):
    next(it)
  with pytest.raises(RuntimeError, match="bad record 3"):  # and keeps saying so
    next(it)
  it.close()


def test_prefetch_state_is_the_consumers_position_and_close_stops_the_thread():
  mesh = jax.make_mesh((8,), ("data",))
  it = global_batch.device_iterator(numbered(10), mesh, buffer_size=3)
  next(it), next(it)
  state = it.get_state()  # the thread is ahead; the state is not
  fresh = global_batch.device_iterator(numbered(10), mesh)
  fresh.set_state(state)
  assert int(np.asarray(next(fresh).arrays["x"])[0, 0]) == 2
  it.set_state(state)  # rewinding the running iterator works too
  assert int(np.asarray(next(it).arrays["x"])[0, 0]) == 2
  for i in (it, fresh):
    i.close()
    i.close()  # idempotent
  assert not any(t.name == "bagel-grain-prefetch" for t in threading.enumerate())
  with pytest.raises(ValueError):
    next(it)


def test_a_global_batch_aliasing_host_memory_keeps_its_buffer_from_reuse():
  """On CPU, JAX may make a global array out of the host batch's own memory (no copy):
  a batch buffer is never written again while such an array lives, whatever the host
  side let go of; once it is gone, the buffer is reused."""
  from packer_samples import batched, groups_of  # pylint: disable=import-outside-toplevel
  groups = groups_of([[300, 200, 500, 100, 50, 400, 250] * 30, [120, 700, 80, 60] * 40])
  mesh = jax.make_mesh((8,), ("data",))
  with iter(batched(groups, 8, expected=700)) as it:
    host = next(it)
    want = {name: np.array(value) for name, value in host.items() if name != "sample_keys"}
    pointers = {host[name].ctypes.data for name in want}
    device = global_batch.make_global_batch(host, mesh)
    aliased = {s.data.unsafe_buffer_pointer() for a in device.arrays.values()
               for s in a.addressable_shards} & pointers
    del host
    for _ in range(5):
      next(it)  # the loop lets go of each batch: the pool's other buffers go round
    assert it.buffer_stats()["reused"] >= 3
    for name, value in want.items():
      np.testing.assert_array_equal(np.asarray(device.arrays[name]), value, err_msg=name)
    reused = it.buffer_stats()["reused"]
    del device
    next(it)
    next(it)
    assert it.buffer_stats()["reused"] == reused + 2
  assert aliased or jax.default_backend() != "cpu"  # else the test would show nothing
