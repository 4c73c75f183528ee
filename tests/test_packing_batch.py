"""The batching stage: rows written into static-shape batches; what Grain cannot do to it."""

import collections
import itertools
import sys
import threading
import time
import types

import grain
import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from bagel_grain.errors import UnsupportedOperationError
from bagel_grain.packing import batch, buffers
from bagel_grain.packing.pack import EMPTY
from bagel_grain.packing.state import STATE_VERSION
from bagel_grain.workers import Fetcher
from bagel_grain.packing.row import RowBuilder, empty_row
from packer_samples import CAPS, batched, groups_of, make_sample, packed
from resume import assert_resumes_identically, assert_same_elements, take


def test_each_batch_row_is_the_row_its_samples_build_alone():
  groups = groups_of([[300, 200, 500, 100, 50, 400, 250], [120, 700, 80, 60]])
  with iter(packed(groups, expected=700)) as rows_it:
    rows = list(rows_it)
  with iter(batched(groups, 2, expected=700)) as it:
    batches = list(it)
  assert len(batches) == -(-len(rows) // 2)
  for r, samples in enumerate(rows):
    builder = RowBuilder(CAPS)
    for s in samples:
      builder.add(s.layout)
    alone, batch = builder.build(), batches[r // 2]
    for name, array in alone.items():
      np.testing.assert_array_equal(batch[name][r % 2], array, err_msg=name)
    assert batch["sample_keys"][r % 2] == tuple(
        (f"g{s.key.group}", s.key.index, s.key.epoch, s.key.record) for s in samples)


def test_the_last_batch_of_a_finite_stream_is_padded_with_empty_rows():
  groups = groups_of([[600] * 4])  # one sample per row: four rows
  with iter(batched(groups, 3, expected=600)) as it:
    first, last = next(it), next(it)
    with pytest.raises(StopIteration):
      next(it)
  assert [len(keys) for keys in first["sample_keys"]] == [1, 1, 1]
  assert last["sample_keys"] == [(("g0", 3, 0, "g0:3"),), (), ()]
  empty = empty_row(CAPS)
  for name, array in empty.items():
    assert last[name].shape == (3, *array.shape)
    np.testing.assert_array_equal(last[name][1], array, err_msg=name)
    np.testing.assert_array_equal(last[name][2], array, err_msg=name)


# --- batch buffers: reused once released, never while held ------------------------------


def copied(batch):
  return {name: np.array(value) if isinstance(value, np.ndarray) else value
          for name, value in batch.items()}


def test_rows_written_into_reused_buffers_are_the_rows_built_alone():
  groups = groups_of([[300, 200, 500, 100, 50, 400, 250] * 3, [120, 700, 80, 60] * 4])
  with iter(packed(groups, expected=700)) as rows_it:
    rows = list(rows_it)
  size = 5
  with iter(batched(groups, size, expected=700)) as it:
    batches = [copied(b) for b in it]  # each batch let go of by the next: buffers reused
    stats = it.buffer_stats()
  # Two buffers: the loop's name holds the last batch while next() writes the other.
  # The last next() met the stream's end.
  assert stats["allocated"] == 2 and stats["reused"] == len(batches) - 1, stats
  assert len(batches) == -(-len(rows) // size) and len(rows) % size  # the last one padded
  empty = empty_row(CAPS)
  for b, batch in enumerate(batches):
    for r in range(size):
      builder, i = RowBuilder(CAPS), size * b + r
      for s in rows[i] if i < len(rows) else ():
        builder.add(s.layout)
      alone = builder.build() if i < len(rows) else empty
      for name, array in alone.items():
        assert batch[name][r].tobytes() == array.tobytes(), (b, r, name)


# What a caller may keep of a batch: the dict, one of its arrays, a view, a buffer export.
HOLDERS = {
    "the batch": lambda b: b,
    "an array": lambda b: b["text_ids"],
    "a view of a row": lambda b: b["vae_images"][1, :8],
    "a view of a view": lambda b: b["vit_patches"][0][3:][::2],
    "a memoryview": lambda b: memoryview(b["timesteps"]),
    "the counts": lambda b: b["num_tokens"].reshape(2, 1),
}


@pytest.mark.parametrize("holder", HOLDERS.values(), ids=HOLDERS.keys())
def test_a_held_batch_is_never_written_again(holder):
  groups = groups_of([[300, 200, 500, 100, 50, 400, 250] * 6, [120, 700, 80, 60] * 8])
  with iter(batched(groups, 2, expected=700)) as it:
    for _ in range(2):  # a buffer or two already in the pool, and released
      next(it)
    batch = next(it)
    held, want = holder(batch), holder(copied(batch))
    del batch
    for _ in range(5):
      next(it)
    assert it.buffer_stats()["reused"] >= 3  # the other buffers went round meanwhile
  if isinstance(held, dict):
    assert_same_elements([held], [want])
  else:
    np.testing.assert_array_equal(np.asarray(held), np.asarray(want))


def _counted_one_less(array):
  """getrefcount as an interpreter that borrows one more reference would count (3.14
  borrows some): this frame's argument and one more left out."""
  return sys.getrefcount(array) - 2


def test_a_held_batch_is_never_written_again_whatever_the_interpreter_counts():
  """What an array only the pool references counts is measured, not assumed: on an
  interpreter that counts one reference fewer, a batch the caller holds would otherwise
  look released, and its buffer be written under it."""
  probe = {"a": np.empty(0)}
  for array in probe.values():  # the stand-in counts one fewer than this interpreter
    assert _counted_one_less(array) == sys.getrefcount(array) - 1
  groups = groups_of([[300, 200, 500, 100, 50, 400, 250] * 6, [120, 700, 80, 60] * 8])
  with pytest.MonkeyPatch.context() as patch, iter(batched(groups, 2, expected=700)) as it:
    patch.setattr(buffers, "sys", types.SimpleNamespace(getrefcount=_counted_one_less))
    for _ in range(2):
      next(it)
    held = next(it)
    want = copied(held)
    for _ in range(5):
      next(it)
    assert it.buffer_stats()["reused"] >= 3  # the released buffers still go round
    assert_same_elements([held], [want])


def test_a_batch_interrupted_after_its_rows_were_written_leaves_nothing_behind():
  """Its buffer holds a row no extent records: reused, a later batch of other rows (here
  after a rewind) would keep the bytes past their end."""
  groups = groups_of([[60, 80, 100, 120, 900] * 6, [50, 60] * 8])
  with iter(batched(groups, 1, expected=700)) as it:
    want = [copied(next(it)) for _ in range(12)]
  tokens = [int(b["num_tokens"][0]) for b in want]
  # A row longer than every row before it and than the row written after the rewind.
  at = next(k for k in range(2, 12) if tokens[k] > max(tokens[:k]))
  writes, write_row = itertools.count(), batch.write_row

  def write(*args, **kwargs):
    extent = write_row(*args, **kwargs)
    if next(writes) == at:  # written, then a Ctrl-C
      raise KeyboardInterrupt
    return extent

  with pytest.MonkeyPatch.context() as patch, iter(batched(groups, 1, expected=700)) as it:
    patch.setattr(batch, "write_row", write)
    got = [copied(next(it))]
    after_first = it.get_state()
    got += [copied(next(it)) for _ in range(at - 1)]
    with pytest.raises(KeyboardInterrupt):
      next(it)
    it.set_state(after_first)  # back: the rows written next are shorter ones
    del got[1:]
    got += [copied(next(it)) for _ in range(11)]
  assert_same_elements(got, want)


def test_batches_are_read_only():
  with iter(batched(groups_of([[100] * 20]), 2)) as it:
    batch = next(it)
  for name in ("text_ids", "vae_images", "num_tokens"):
    with pytest.raises(ValueError, match="read-only"):
      batch[name][...] = 1
  changed = copied(batch)  # the documented way: copy, then change
  changed["text_ids"][0, 0] = 5
  assert changed["text_ids"][0, 0] == 5


def test_state_is_sealed_with_version_and_fingerprint():
  ds = batched(groups_of([[100] * 50]), 2)
  with iter(ds) as it:
    next(it)
    state = it.get_state()
  assert state["version"] == STATE_VERSION and state["fingerprint"] == {"test": 1}
  assert state["next_index"] and "buffer" in state and "stats" in state


def test_state_round_trip_continues_identically():
  ds = batched(groups_of([[300, 200, 500, 100, 50, 400, 250] * 6, [120, 700, 80, 60] * 8]), 2,
               expected=700, mandatory=[False, True])
  assert_resumes_identically(lambda: iter(ds), steps=20, at=[0, 2, 9])


@pytest.mark.parametrize("operation, advice", [
    (lambda ds: ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)), "workers=N"),
    (lambda ds: ds.batch(4), "batch_size="),
    (lambda ds: ds[:3], "islice"),
    (lambda ds: ds[0], "no random access"),
])
def test_grain_operations_that_cannot_apply_say_what_to_use(operation, advice):
  with pytest.raises(UnsupportedOperationError, match=advice):
    operation(batched(groups_of([[100] * 10]), 2))


def test_a_data_loader_over_the_stream_says_it_has_no_random_access():
  ds = batched(groups_of([[100] * 10]), 2)
  loader = grain.DataLoader(data_source=ds, sampler=grain.samplers.IndexSampler(
      num_records=4, shuffle=False, seed=0), worker_count=0)
  with pytest.raises(UnsupportedOperationError, match="no random access"):
    next(iter(loader))


def test_islice_is_the_way_to_take_a_few():
  with iter(batched(groups_of([[100] * 40]), 2)) as it:
    assert len(list(itertools.islice(it, 3))) == 3


# --- one next() is one transaction; other threads see a consistent position -------------


class Interrupting:
  """The inline fetcher, raising KeyboardInterrupt at the chosen calls of `get`; `delay_s`
  makes each element slow, so that other threads meet a next() in progress."""

  def __init__(self, groups, at=(), delay_s=0.0):
    self.inner = Fetcher(groups, workers=0, depths=[0] * len(groups))
    self.at, self.calls, self.delay_s = set(at), 0, delay_s

  def get(self, group, index):
    self.calls += 1
    if self.calls in self.at:
      raise KeyboardInterrupt
    time.sleep(self.delay_s)
    return self.inner.get(group, index)

  def get_many(self, keys):
    return self.inner.get_many(keys)

  def put_back(self, group, index, element):
    self.inner.put_back(group, index, element)

  def reset(self):
    self.inner.reset()

  def close(self):
    self.inner.close()


SIZES = [[300, 200, 500, 100, 50, 400, 250] * 5, [120, 700, 80, 60] * 8]


def transaction_groups():
  groups = groups_of(SIZES)
  for i in (3, 11, 20):  # drops too: counted, and counted once
    groups[0][i] = make_sample(0, i, 10, drop_reason="bad_image")
  return groups


def balanced(stats):
  return stats["drawn"] == stats["packed"] + stats["dropped"] + stats["buffered"] + \
      stats["carried"]


def batch_keys(batches):
  return [tuple(b["sample_keys"]) for b in batches]


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(fetch_at=st.sets(st.integers(1, 150), max_size=8),
                  write_at=st.sets(st.integers(1, 30), max_size=4))
def test_a_next_interrupted_anywhere_loses_and_repeats_nothing(fetch_at, write_at):
  groups = transaction_groups()
  with iter(batched(groups, 2, expected=700, mandatory=[False, True])) as it:
    want = take(it, 12)
  writes, write_row = itertools.count(1), batch.write_row

  def write(*args, **kwargs):
    n = next(writes)
    if n in write_at:
      if n % 2:  # a Ctrl-C once the row's bytes are written: that buffer must not be reused
        write_row(*args, **kwargs)
      raise KeyboardInterrupt
    return write_row(*args, **kwargs)

  got = []
  with pytest.MonkeyPatch.context() as patch, iter(batched(
      groups, 2, expected=700, mandatory=[False, True],
      fetcher=lambda gs: Interrupting(gs, fetch_at))) as it:
    patch.setattr(batch, "write_row", write)
    while len(got) < len(want):
      before = it.get_state()
      try:
        got.append(copied(next(it)))  # let go of: buffers are reused, interrupted ones not
      except KeyboardInterrupt:
        assert it.get_state() == before  # nothing of the interrupted next() stayed
      except StopIteration:
        break
      assert balanced(it.stats())
  assert_same_elements(got, want)


class Counting(list):
  """A group whose elements count how often each is computed."""

  def __init__(self, items, computed):
    super().__init__(items)
    self.computed = computed

  def __getitem__(self, index):
    value = super().__getitem__(index)
    if isinstance(index, int):
      self.computed[value.key.group, index] += 1
    return value


def test_a_failed_next_keeps_the_elements_it_drew_for_the_next_try():
  """A step tried again (a storage error, a Ctrl-C) takes what it drew before, rather
  than computing it again (in the main process, while workers run: issue 27's soak)."""
  computed = collections.Counter()
  groups = [Counting(g, computed) for g in transaction_groups()]
  with iter(batched(groups, 2, expected=700, mandatory=[False, True])) as it:
    want = take(it, 6)
  computed.clear()
  got = []
  with iter(batched(groups, 2, expected=700, mandatory=[False, True],
                    fetcher=lambda gs: Interrupting(gs, at={9, 25, 26, 60}))) as it:
    while len(got) < len(want):
      try:
        got.append(copied(next(it)))
      except KeyboardInterrupt:
        pass
  assert_same_elements(got, want)
  assert computed and max(computed.values()) == 1, computed.most_common(3)


def test_get_state_and_stats_from_another_thread_are_consistent():
  groups = transaction_groups()
  seen, stop = [], threading.Event()

  def watch(it):
    while not stop.is_set():
      state, stats = it.get_state(), it.stats()
      drawn = sum(c.get("drawn", 0) for c in state["stats"]["counts"].values())
      packed = sum(c.get("packed", 0) for c in state["stats"]["counts"].values())
      dropped = sum(sum(d) for d in state["stats"]["drops"].values())
      waiting = [k for k in state["buffer"] + state["carried"] if k != EMPTY]
      seen.append((drawn == packed + dropped + len(waiting),
                   balanced(stats)))

  with iter(batched(groups, 2, expected=700, mandatory=[False, True],
                    fetcher=lambda gs: Interrupting(gs, delay_s=0.002))) as it:
    watcher = threading.Thread(target=watch, args=(it,))
    watcher.start()
    try:
      take(it, 10)
    finally:
      stop.set()
      watcher.join()
  assert len(seen) > 10 and all(ok == (True, True) for ok in seen), seen


def test_two_threads_calling_next_take_turns():
  groups = transaction_groups()
  with iter(batched(groups, 2, expected=700, mandatory=[False, True])) as it:
    want = batch_keys(take(it, 12))
  got = []
  with iter(batched(groups, 2, expected=700, mandatory=[False, True],
                    fetcher=lambda gs: Interrupting(gs, delay_s=0.001))) as it:
    threads = [threading.Thread(target=lambda: got.extend(take(it, 6))) for _ in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  for b in got:
    assert [len(keys) for keys in b["sample_keys"]] == b["num_samples"].tolist()
  assert sorted(batch_keys(got)) == sorted(want)


def test_next_after_close_raises():
  it = iter(batched(groups_of(SIZES), 2))
  next(it)
  it.close()
  with pytest.raises(ValueError, match="closed"):
    next(it)
