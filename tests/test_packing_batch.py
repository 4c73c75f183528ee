"""The batching stage: rows written into static-shape batches; what Grain cannot do to it."""

import itertools

import grain
import numpy as np
import pytest

from bagel_grain.errors import UnsupportedOperationError
from bagel_grain.packing.row import RowBuilder, empty_row
from packer_samples import CAPS, batched, groups_of, packed
from resume import assert_resumes_identically, take


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


def test_state_is_sealed_with_version_and_fingerprint():
  ds = batched(groups_of([[100] * 50]), 2)
  with iter(ds) as it:
    next(it)
    state = it.get_state()
  assert state["version"] == 2 and state["fingerprint"] == {"test": 1}
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
