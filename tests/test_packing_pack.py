"""The packing stage: BAGEL's row rules and their invariants on synthetic groups."""

import collections

import hypothesis
import numpy as np
from hypothesis import strategies as st

from bagel_grain.packing.pack import EMPTY
from bagel_grain.packing.row import Capacities
from packer_samples import make_sample, packed
from resume import assert_resumes_identically, take


def rows_of(ds, n=None):
  """The iterator (closed) and its rows: all of them, or the first `n`."""
  with iter(ds) as it:
    rows = list(it) if n is None else take(it, n)
  return it, rows


def indices(rows):
  return [[s.key.index for s in row] for row in rows]


def assert_accounting(it, rows):
  stats = it.stats()
  assert stats["drawn"] == stats["packed"] + stats["dropped"] + stats["buffered"] + stats["carried"]
  keys = [s.key for row in rows for s in row]
  assert len(keys) == len(set(keys)) == stats["packed"]


group_sizes = st.lists(st.integers(1, 700), min_size=1, max_size=40)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(sizes=st.lists(group_sizes, min_size=1, max_size=3),
                  mandatory=st.lists(st.booleans(), min_size=3, max_size=3),
                  expected=st.integers(100, 1024), buffer=st.integers(0, 5),
                  prefer=st.integers(0, 1024), images=st.booleans())
def test_invariants_on_random_streams(sizes, mandatory, expected, buffer, prefer, images):
  groups = [[make_sample(g, i, n, vae=images and i % 2 == 0, vit=images and i % 3 == 0)
             for i, n in enumerate(group)] for g, group in enumerate(sizes)]
  ds = packed(groups, mandatory=mandatory[:len(groups)], expected=expected, buffer=buffer,
              prefer=prefer, per_sample=600)
  it, rows = rows_of(ds)
  caps = ds.spec.capacities
  for row in rows:
    # Within the token budget by upstream's estimate, hence within L too.
    assert sum(s.packed_size for s in row) <= 1024
    assert sum(s.layout.num_vae_tokens for s in row) <= caps.vae_tokens
    assert sum(s.layout.num_vae_images for s in row) <= caps.vae_images
  # Each group's samples appear once, in index order within the group's stream.
  packed_keys = [s.key for row in rows for s in row]
  for g in range(len(groups)):
    idx = [k.index for k in packed_keys if k.group == g]
    assert sorted(idx) == sorted(set(idx))
  # Finite groups: at the end nothing is left buffered or carried, every sample is
  # packed or dropped for being over the per-sample limit.
  stats = it.stats()
  assert stats["buffered"] == stats["carried"] == 0
  assert_accounting(it, rows)
  over = sum(s.packed_size > 600 for g in groups for s in g)
  assert stats["dropped"] == over
  assert stats["packed"] == sum(len(g) for g in groups) - over


def test_three_mandatory_groups_never_overflow_and_lose_nothing():
  # Upstream overflows max_num_tokens here (4096/5120/4096 with three mandatory groups).
  rng = np.random.default_rng(0)
  groups = [[make_sample(g, i, int(n)) for i, n in enumerate(rng.integers(500, 3000, 60))]
            for g in range(3)]
  caps = Capacities(tokens=5120, vit_patches=5120, vae_tokens=5120, vae_images=4,
                    vae_image_size=32, splits=2560)
  it, rows = rows_of(packed(groups, mandatory=[True] * 3, expected=4096, max_tokens=5120,
                            per_sample=4096, prefer=2048, buffer=50, caps=caps), 40)
  for row in rows:
    assert sum(s.packed_size for s in row) <= 5120
  assert_accounting(it, rows)
  missing = sum(it.stats()["missing_mandatory"].values())
  lacking = sum(1 for row in rows for g in range(3) if g not in {s.key.group for s in row})
  assert missing == lacking > 0  # mandatory samples were carried, and counted


def test_full_buffer_loses_no_sample():
  # Upstream discards the sample in hand when its buffer is full; we carry it.
  groups = [[make_sample(0, i, 300 + 50 * (i % 7)) for i in range(200)],
            [make_sample(1, i, 700) for i in range(200)]]
  it, rows = rows_of(packed(groups, expected=1000, max_tokens=1024, buffer=1, prefer=0))
  assert_accounting(it, rows)
  assert it.stats()["packed"] == 400 and it.stats()["dropped"] == 0


def test_carried_sample_starts_the_next_row():
  groups = [[make_sample(0, i, n) for i, n in enumerate([600, 600, 100, 100])]]
  _, rows = rows_of(packed(groups, expected=1000, max_tokens=1024, buffer=0, prefer=0))
  assert indices(rows) == [[0], [1, 2, 3]]


def test_prefer_buffer_before_takes_the_buffered_sample_and_carries_it():
  # Sizes (+2 markers each): 502, 602, 302, 202, 52; budget 1024, close at 1000.
  groups = [[make_sample(0, i, n) for i, n in enumerate([500, 600, 300, 200, 50])]]
  _, rows = rows_of(packed(groups, expected=1000, max_tokens=1024, buffer=4, prefer=900))
  # Row 1: 0 fits; 1 does not -> buffered; below `prefer` the buffer is served
  # first, 1 still does not fit -> carried (upstream loses it here), row closes.
  # Row 2: carried 1, then 2 (904); 3 does not fit -> buffered; 4 fits (956); the
  # groups are exhausted, so the buffer drains: 3 does not fit -> carried.
  assert indices(rows) == [[0], [1, 2, 4], [3]]


def test_mandatory_group_appears_in_every_row():
  groups = [[make_sample(0, i, 100) for i in range(400)],
            [make_sample(1, i, 50) for i in range(400)]]
  _, rows = rows_of(packed(groups, weights=[1.0, 0.0], mandatory=[False, True], expected=900),
                    20)
  # Weight 0: only the mandatory sample of g1 per row.
  assert all(sum(s.key.group == 1 for s in row) == 1 for row in rows)


def test_dropped_elements_are_counted_and_replaced_from_the_same_group():
  groups = [[make_sample(0, i, 100, drop_reason="bad_image" if i % 3 == 0 else None)
             for i in range(90)]]
  it, rows = rows_of(packed(groups, expected=900))
  assert it.stats()["drops"]["g0"] == {"bad_image": 30}
  assert it.stats()["packed"] == 60
  assert_accounting(it, rows)


def test_row_counters_and_epochs_in_stats():
  groups = [[make_sample(0, i, 100) for i in range(10)], [make_sample(1, i, 100) for i in range(10)]]
  it, rows = rows_of(packed(groups, expected=500), 3)
  stats = it.stats()
  assert stats["rows"] == 3 == len(rows)
  assert stats["tokens"] == sum(s.layout.num_tokens for row in rows for s in row)
  assert set(stats["epoch"]) == {"g0", "g1"} and set(stats["epoch"].values()) == {0}


def test_state_round_trip_continues_identically():
  rng = np.random.default_rng(3)
  groups = [[make_sample(g, i, int(n)) for i, n in enumerate(rng.integers(50, 700, 300))]
            for g in range(2)]
  ds = packed(groups, mandatory=[True, False], buffer=3, prefer=500)
  rows = assert_resumes_identically(lambda: iter(ds), steps=40, at=[0, 1, 7, 20])
  assert len(rows) == 40


def test_state_holds_the_buffered_and_carried_keys():
  groups = [[make_sample(0, i, n) for i, n in enumerate([500, 600, 300, 200, 50])]]
  with iter(packed(groups, expected=1000, max_tokens=1024, buffer=4, prefer=900)) as it:
    next(it)
    state = it.get_state()
  # After row 1 (see the prefer_buffer_before test): sample 1 carried, nothing buffered.
  # Fixed-length lists: 4 buffer slots; carried slots for as many as the rules allow.
  assert state["carried"][0] == [0, 1] and all(k == EMPTY for k in state["carried"][1:])
  assert state["buffer"] == [EMPTY] * 4
  assert state["next_index"] == [2] and state["stats"]["rows"] == 1
  assert collections.Counter(state["stats"]["counts"]["g0"]) == {"drawn": 2, "packed": 1}
