"""The interleaving stage: the served shards' rows in the fewest-rows-first order, one
shared fetcher, and a state split into one part per logical shard."""

import pytest

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.mix import inline_fetcher
from bagel_grain.packing.shards import ShardInterleaveDataset, joined_states, split_state
from packer_samples import make_sample, packed
from resume import take


def shard_groups(lengths):
  """One group of samples of these text lengths."""
  return [[make_sample(0, i, n, vae=i % 2 == 0) for i, n in enumerate(lengths)]]


# Shards told apart by their samples' sizes.
SHARDS = {0: shard_groups([300] * 9), 3: shard_groups([200] * 20)}


def interleaved(shards=SHARDS, shard_count=4, fetcher=inline_fetcher):
  return ShardInterleaveDataset({s: packed(g) for s, g in shards.items()},
                                shard_count=shard_count, fetcher=fetcher)


def keys(row):
  return tuple((s.key.index, s.packed_size) for s in row)


def alone(groups):
  with iter(packed(groups)) as it:
    return [keys(r) for r in it]


def test_rows_come_from_the_shard_with_fewest_rows_lowest_first_until_each_ends():
  own = {s: alone(g) for s, g in SHARDS.items()}
  assert len(own[0]) < len(own[3])  # so that shard 0 ends first
  expected = []
  for i in range(max(map(len, own.values()))):
    expected += [own[s][i] for s in sorted(own) if i < len(own[s])]
  with iter(interleaved()) as it:
    assert [keys(r) for r in it] == expected


def test_the_shards_share_one_fetcher_made_once_per_iterator():
  made = []

  def fetcher(groups):
    made.append(len(groups))
    return inline_fetcher(groups)

  ds = interleaved(fetcher=fetcher)
  with iter(ds) as it:
    take(it, 3)
  assert made == [2]  # one group per shard, both through one fetcher
  with iter(ds):
    pass
  assert made == [2, 2]


def test_a_state_restores_the_rest_of_the_stream():
  with iter(interleaved()) as it:
    take(it, 5)
    state = it.get_state()
    rest = [keys(r) for r in it]
  with iter(interleaved()) as it:
    it.set_state(state)
    assert [keys(r) for r in it] == rest


def test_a_state_splits_into_one_part_per_shard_and_joins_back():
  with iter(interleaved()) as it:
    take(it, 4)
    state = it.get_state()
  parts = split_state(state)
  assert sorted(parts) == [0, 3]
  assert all(p["logical_shards"] == 4 and p["shard"] == s for s, p in parts.items())
  assert joined_states(reversed(list(parts.values()))) == state


def test_joining_refuses_a_shard_saved_twice_parts_of_other_streams_and_nothing():
  with iter(interleaved()) as it:
    take(it, 4)
    state = it.get_state()
  parts = split_state(state)
  with pytest.raises(StateMismatchError, match="logical shard 0 was saved twice"):
    joined_states([parts[0], parts[0]])
  other = {**parts[3], "logical_shards": 5}
  with pytest.raises(StateMismatchError, match="another stream"):
    joined_states([parts[0], other])
  with pytest.raises(StateMismatchError, match="no logical shard states"):
    joined_states([])


def test_a_state_without_a_served_shard_or_of_another_shard_count_is_refused_unchanged():
  with iter(interleaved()) as it:
    take(it, 2)
    state = it.get_state()
    rest = [keys(r) for r in take(it, 3)]
  with iter(interleaved()) as it:
    take(it, 2)
    missing = {**state, "shards": {"0": state["shards"]["0"]}}
    with pytest.raises(StateMismatchError, match=r"no entry for logical shards \[3\]"):
      it.set_state(missing)
    with pytest.raises(StateMismatchError, match="saved with 5 logical shards"):
      it.set_state({**state, "logical_shards": 5})
    assert [keys(r) for r in take(it, 3)] == rest  # where it was
