"""The mixing stage: weighted draws, each group read in order, drops replaced, its state."""

import collections
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bagel_grain.errors import StateMismatchError
from bagel_grain.workers import Fetcher
from bagel_grain.packing.mix import (
    MANDATORY_READ_AHEAD, MIN_READ_AHEAD, READ_AHEAD_PER_WORKER, draw_group, draw_uniform,
    group_at, read_ahead)
from bagel_grain.packing.shares import cumulative_shares
from packer_samples import make_sample, mixed
from resume import assert_resumes_identically, take


class RecordingFetcher:
  """The in-process fetcher, noting every (group, index) asked for and its closing."""

  def __init__(self, groups):
    self.inner = Fetcher(groups, workers=0, depths=[0] * len(groups))
    self.asked, self.closed = [], 0

  def get(self, group, index):
    self.asked.append((group, index))
    return self.inner.get(group, index)

  def get_many(self, keys):
    self.asked.extend(keys)
    return self.inner.get_many(keys)

  def put_back(self, group, index, element):
    self.inner.put_back(group, index, element)

  def reset(self):
    self.inner.reset()

  def close(self):
    self.closed += 1
    self.inner.close()  # else its thread keeps it live: a later test's `fetcher.live()` sees it


def test_draws_follow_the_weights():
  groups = [[make_sample(g, i, 20) for i in range(20000)] for g in range(3)]
  with iter(mixed(groups, weights=[1.0, 2.0, 5.0])) as it:
    counts = collections.Counter(s.key.group for s in take(it, 4000))
  for g, w in enumerate((1 / 8, 2 / 8, 5 / 8)):
    assert abs(counts[g] / 4000 - w) < 0.03


def test_each_group_is_read_in_index_order_through_the_fetcher_given():
  groups = [[make_sample(0, i, 10) for i in range(3)], [make_sample(1, i, 10) for i in range(5)]]
  fetchers = []
  ds = mixed(groups, fetcher=lambda gs: fetchers.append(RecordingFetcher(gs)) or fetchers[-1])
  with iter(ds) as it:
    samples = list(it)  # ends when every group is exhausted
  assert len(fetchers) == 1 and fetchers[0].closed == 1
  for g, size in ((0, 3), (1, 5)):
    assert [i for gg, i in fetchers[0].asked if gg == g] == list(range(size))
    assert [s.key.index for s in samples if s.key.group == g] == list(range(size))


def test_next_of_takes_the_groups_next_usable_sample_and_none_at_its_end():
  groups = [[make_sample(0, i, 10) for i in range(5)],
            [make_sample(1, i, 10, drop_reason="bad_json" if i < 2 else None) for i in range(3)]]
  with iter(mixed(groups, weights=[1.0, 0.0])) as it:
    assert it.next_of(1).key.index == 2  # 0 and 1 dropped, counted
    assert it.next_of(1) is None and it.exhausted(1)
    # A weight-0 group is never drawn by weight; the others still are.
    assert [s.key.group for s in it] == [0] * 5
    state = it.get_state()
  assert state["next_index"] == [5, 3]
  drops = dict(zip(state["stats"]["drop_reasons"], state["stats"]["drops"]["g1"]))
  assert drops["bad_json"] == 2 and sum(drops.values()) == 2
  assert state["stats"]["counts"] == {"g0": {"drawn": 5}, "g1": {"drawn": 3}}


def test_a_draw_depends_only_on_seed_process_and_draw_number():
  active = [True, True, True]
  draws = [draw_group(5, 0, d, [1.0, 1.0, 1.0], active) for d in range(200)]
  assert draws == [draw_group(5, 0, d, [1.0, 1.0, 1.0], active) for d in range(200)]
  assert draws != [draw_group(5, 1, d, [1.0, 1.0, 1.0], active) for d in range(200)]
  # An exhausted group is never drawn; the draw's uniform is the same, so only the
  # draws that would have taken it change.
  without = [draw_group(5, 0, d, [1.0, 1.0, 1.0], [True, False, True]) for d in range(200)]
  assert 1 not in without
  assert all(a == b for a, b in zip(draws, without) if a != 1)


@settings(max_examples=300, deadline=None)
@given(seed=st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32 - 2, 2**70)),
       process=st.integers(0, 2**33), draw=st.integers(0, 2**34))
def test_a_draw_is_the_generator_keyed_by_the_list_of_its_numbers(seed, process, draw):
  """Keyed by uint32 words when every number fits one (faster), by the list otherwise:
  the same uniform either way, on both sides of 2**32."""
  want = np.random.default_rng([seed, 0xD7A3, process, draw]).random()
  assert draw_uniform(seed, process, draw) == want


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=6),
       active=st.lists(st.booleans(), min_size=6, max_size=6),
       u=st.floats(0.0, 1.0, exclude_max=True), at_bound=st.booleans())
def test_the_group_of_a_uniform_is_the_searchsorted_one(weights, active, u, at_bound):
  """The drawn group is the first cumulative share above the draw's uniform, as
  `np.searchsorted(side="right")` finds it on the shares' floats (a draw exactly on a
  bound, or above the last bound that rounding left under 1, included)."""
  active = [a and w > 0 for a, w in zip(active, weights)]
  if not any(active):
    return
  cumulative = cumulative_shares(weights, active)
  if at_bound:
    u = float(cumulative[int(u * len(cumulative))])
  expected = int(min(np.searchsorted(cumulative, u, side="right"), len(weights) - 1))
  assert group_at(u, cumulative.tolist()) == expected


def test_read_ahead_grows_with_workers_by_weight():
  assert read_ahead([1.0, 3.0], [False, True], 0) == [MIN_READ_AHEAD,
                                                      MIN_READ_AHEAD + MANDATORY_READ_AHEAD]
  one, three = read_ahead([1.0, 3.0], [False, False], 2)
  assert one == MIN_READ_AHEAD + READ_AHEAD_PER_WORKER * 2 // 4
  assert three == MIN_READ_AHEAD + READ_AHEAD_PER_WORKER * 2 * 3 // 4


def test_state_round_trip_continues_identically():
  rng = np.random.default_rng(1)
  groups = [[make_sample(g, i, int(n), drop_reason="bad_image" if n < 60 else None)
             for i, n in enumerate(rng.integers(10, 400, 200))] for g in range(3)]
  ds = mixed(groups, weights=[1.0, 2.0, 0.5])
  assert_resumes_identically(lambda: iter(ds), steps=120, at=[0, 1, 33, 119])


def test_epochs_count_passes_over_each_group():
  groups = [[make_sample(0, i, 10) for i in range(4)]]  # two epochs of two records
  ds = mixed(groups)
  ds.spec = dataclasses.replace(ds.spec, records_per_epoch=(2,))
  with iter(ds) as it:
    take(it, 3)
    assert it.epochs() == {"g0": 1}


def test_recreating_a_key_that_no_longer_is_a_sample_is_refused():
  groups = [[make_sample(0, 0, 10), make_sample(0, 1, 10, drop_reason="bad_image")]]
  with iter(mixed(groups)) as it:
    assert it.recreate([[0, 0]])[0].key.index == 0
    with pytest.raises(StateMismatchError, match="'g0' element 1 .*the data changed"):
      it.recreate([[0, 1]])


EXIT_SCRIPT = """
import functools, sys
sys.path.insert(0, {tests!r})
from bagel_grain.workers import Fetcher
from packer_samples import make_sample, mixed

if __name__ == "__main__":
  groups = [[make_sample(0, i, 10) for i in range(40)]]
  it = iter(mixed(groups, fetcher=functools.partial(Fetcher, workers=2, depths=[4])))
  next(it)
  if {close}:
    it.close()
    it.close()
  print("exiting")
"""


@pytest.mark.parametrize("close", [False, True])
def test_a_script_with_workers_exits_quietly_closed_or_not(tmp_path, close):
  script = tmp_path / "script.py"
  script.write_text(EXIT_SCRIPT.format(tests=str(Path(__file__).parent), close=close))
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=120, check=False)
  assert (done.returncode, done.stdout, done.stderr) == (0, "exiting\n", "")
