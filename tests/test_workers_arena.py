"""Batch buffers' pixels in a shared arena, copied there by the workers that hold the samples:
the same bits as copies made here, slots reused only once free (and never while a copy may
still land), a dead or stalled worker a clear error, nothing left behind."""

import gc
import mmap
import signal

import numpy as np
import psutil
import pytest

from big_elements import Pixels
from deadline import deadline
from resume import assert_same_elements
from test_workers_slab import arenas_held, owner, started
from bagel_grain import build_pipeline
from bagel_grain.workers import Fetcher, WorkerError
from bagel_grain.workers.arena import Arena

SPECS = {"patches": ((4, 1000), np.uint8), "images": ((2, 64, 64, 3), np.uint8)}


def arena(slots: int = 2) -> Arena:
  made = Arena.create(SPECS, slots)
  if made is None:
    pytest.skip("no memfd on this system")
  return made


def test_a_slot_is_zero_arrays_of_the_mapping_and_comes_back_zero_once_dropped():
  shared = arena(slots=1)
  slot, arrays = shared.take()
  assert shared.take() is None  # the only slot is taken
  assert {k: (a.shape, a.dtype) for k, a in arrays.items()} == {
      k: (s, np.dtype(t)) for k, (s, t) in SPECS.items()}
  for array in arrays.values():
    assert not array.any() and isinstance(array.base, mmap.mmap)  # every view counts
    array[...] = 7
  view = arrays["images"][1, :3]
  del arrays, array
  gc.collect()
  assert shared.take() is None  # a view still holds it
  del view
  again, arrays = shared.take()
  assert again == slot and not any(a.any() for a in arrays.values())


def test_a_slot_whose_copies_were_not_all_acknowledged_is_never_used_again():
  shared = arena(slots=1)
  slot, arrays = shared.take()
  shared.copying(slot, True)  # a worker may still write into it
  del arrays
  gc.collect()
  assert shared.take() is None and shared.lost == 1


def in_slabs(fetcher: Fetcher, count: int) -> list:
  """The first `count` elements that came from a worker (through its slab)."""
  out = []
  for i in range(40):
    element = fetcher.get(0, i)
    if type(owner(element["pixels"])).__name__ == "mmap":
      out.append(element)
    if len(out) == count:
      return out
  raise AssertionError("the workers sent fewer elements than that")


def copies_of(fetcher: Fetcher, shared: Arena, elements, destination):
  by_worker = {}
  for i, element in enumerate(elements):
    worker, at = fetcher.slab_of(element["pixels"])
    by_worker.setdefault(worker, []).append((shared.where(destination[i]), at))
  return by_worker


def test_workers_copy_their_slabs_arrays_into_the_arena():
  shared = arena()
  with deadline(120):
    fetcher = started(Fetcher([Pixels(40, 4000, slow_here_s=0.5)], workers=2, depths=[4]))
    try:
      elements = in_slabs(fetcher, 4)
      slot, arrays = shared.take()
      patches, images = arrays["patches"], arrays["images"]
      strided = [{"pixels": e["pixels"][::4]} for e in elements]  # strided sources
      fetcher.copy_and_wait(shared, copies_of(fetcher, shared, strided, patches))
      for i, e in enumerate(elements):
        np.testing.assert_array_equal(patches[i], e["pixels"][::4])
      corner = [{"pixels": e["pixels"][:3 * 10 * 3].reshape(3, 10, 3)} for e in elements[:2]]
      fetcher.copy_and_wait(shared, copies_of(fetcher, shared, corner, images[:, :3, :10]))
      for i in range(2):  # strided destinations: the image's corner, zero around
        np.testing.assert_array_equal(images[i, :3, :10], corner[i]["pixels"])
        assert images[i].sum() == corner[i]["pixels"].sum()
      assert all(arenas_held(w["pid"]) >= 1 for w in fetcher.worker_memory())
    finally:
      fetcher.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_worker_that_dies_or_stalls_mid_copy_is_a_clear_error(how):
  shared = arena()
  with deadline(120):
    fetcher = started(Fetcher([Pixels(40, 4000, slow_here_s=0.5)], workers=1, depths=[2],
                              timeout_s=3))
    victim = psutil.Process(fetcher.worker_memory()[0]["pid"])
    try:
      elements = in_slabs(fetcher, 2)
      slot, arrays = shared.take()
      copies = copies_of(fetcher, shared, elements, arrays["patches"])
      victim.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
      message = "killed by SIGKILL" if how == "killed" else "did not copy a batch's pixels"
      with pytest.raises(WorkerError, match=message):
        fetcher.copy_and_wait(shared, copies)
    finally:
      if how == "stopped":
        victim.send_signal(signal.SIGKILL)
      fetcher.close()


def test_the_arena_is_released_when_the_pipeline_closes(demo_config, demo_tokenizer):
  with deadline(300):
    it = iter(build_pipeline(demo_config, demo_tokenizer, batch_size=2, workers=2))
    next(it)
    pids = [w["pid"] for w in it._rows.fetcher.worker_memory()]  # pylint: disable=protected-access
    it.close()
  gc.collect()
  assert arenas_held() == 0
  assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                 for pid in pids)


def test_two_workers_write_the_pixels_and_the_batches_are_the_same(demo_config, demo_tokenizer):
  def run(workers):
    it = iter(build_pipeline(demo_config, demo_tokenizer, batch_size=2, workers=workers))
    out = [next(it)]
    if workers:
      started(it._rows.fetcher)  # pylint: disable=protected-access
    for _ in range(11):
      batch = next(it)
      out.append({k: np.array(v) if isinstance(v, np.ndarray) else v
                  for k, v in batch.items()})
      del batch  # its buffer goes back to the pool: slots are reused
    shared = it._buffers.arena  # pylint: disable=protected-access
    it.close()
    return out, shared
  with deadline(300):
    want, none = run(0)
    got, shared = run(2)
  assert none is None
  assert shared is not None and shared.delegated > 0 and shared.lost == 0
  assert_same_elements(got, want)


def test_a_result_that_does_not_pickle_ends_its_worker_not_just_its_compute_thread():
  # The worker computes on a thread of its own: a failure there must still end the process
  # (the pump reports its exit at once), not leave the element to time out.
  from big_elements import Unpicklable  # pylint: disable=import-outside-toplevel
  with deadline(120):
    fetcher = started(Fetcher([Unpicklable()], workers=1, depths=[0], timeout_s=600))
    try:
      with pytest.raises(WorkerError, match=r"exited \(exit code 1\) with group 0 element"):
        for i in range(40):  # (the main process computes any no worker took yet)
          fetcher.get(0, i)
    finally:
      fetcher.close()
