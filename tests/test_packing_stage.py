"""What the stage iterators share: closing with `with`, their own time in Grain's stats."""

import pytest

import dataclasses

from bagel_grain.packing.stage import with_stage_timing
from bagel_grain.pipeline import build_pipeline
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
  assert set(seconds) == {"BatchIterator", "PackIterator", "MixIterator"}
  assert all(s > 0 for s in seconds.values()), seconds


@pytest.mark.parametrize("logical_shards", [None, 1, 8])
def test_grain_sees_every_stage_of_the_pipeline_build_pipeline_makes(
    demo_config, demo_tokenizer, logical_shards):
  """The graph Grain sees is the one docs/architecture.md draws: batching ->
  interleaving -> per shard, packing -> mixing; each stage's own time is recorded."""
  cfg = dataclasses.replace(demo_config, logical_shards=logical_shards)
  ds = with_stage_timing(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=0))
  with iter(ds) as it:
    take(it, 2)
    seconds = it.stage_seconds()
  assert set(seconds) == {"BatchIterator", "ShardInterleaveIterator", "PackIterator",
                          "MixIterator"}
  assert all(s > 0 for s in seconds.values()), seconds
