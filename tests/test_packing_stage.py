"""What the stage iterators share: closing with `with`, their own time in Grain's stats."""

import pytest

from bagel_grain.packing.stage import get_execution_summary, with_stage_timing
from packer_samples import batched, groups_of, make_sample
from resume import take


def test_iterators_are_context_managers_and_close_once():
  ds = batched(groups_of([[100] * 50]), 2)
  with iter(ds) as it:
    next(it)
  it.close()  # again: nothing happens
  with pytest.raises(ValueError, match="closed"):
    next(it)


def test_closing_the_outer_stage_closes_the_fetcher_of_the_first():
  closed = []

  class Fetcher:
    def get(self, group, index):
      return groups[group][index]

    def close(self):
      closed.append(True)

  groups = [[make_sample(0, i, 10) for i in range(5)]]
  with iter(batched(groups, 2, fetcher=lambda gs: Fetcher())) as it:
    next(it)
  it.close()
  assert closed == [True]


def test_stage_times_reach_grains_execution_summary():
  ds = with_stage_timing(batched(groups_of([[200] * 60, [300] * 60]), 2, expected=600))
  with iter(ds) as it:
    take(it, 3)
    seconds = it.stage_seconds()
    summary = get_execution_summary(it)
  nodes = {n.name.split("(")[0]: n for n in summary.nodes.values()}
  assert set(nodes) == set(seconds) == {"BatchIterator", "PackIterator", "MixIterator"}
  assert nodes["BatchIterator"].num_produced_elements == 3
  assert nodes["PackIterator"].num_produced_elements == 6  # one per row
  assert nodes["MixIterator"].num_produced_elements >= 6  # one per draw
  assert all(s > 0 for s in seconds.values())
