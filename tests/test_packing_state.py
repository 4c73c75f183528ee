"""The state's envelope: version and fingerprint checked before anything is restored."""

import json

import pytest

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.state import STATE_VERSION, StreamIdentity, sealed
from bagel_grain.packing.state import opened as opened_with
from packer_samples import batched, groups_of

FINGERPRINT = {"config": "abc", "seed": 1}


def opened(state, fingerprint):
  """The stages' part of `state`, for a stream of this fingerprint."""
  return opened_with(state, StreamIdentity(fingerprint))


def test_sealed_then_opened_gives_the_stages_state_back():
  inner = {"next_index": [3], "draws": 2, "buffer": [], "carried": [], "stats": {}}
  state = sealed(inner, FINGERPRINT)
  assert list(state)[:2] == ["version", "fingerprint"] and state["version"] == STATE_VERSION
  assert opened(state, FINGERPRINT) == inner


def test_another_version_is_refused():
  with pytest.raises(StateMismatchError,
                     match=r"version 7; this bagel_grain reads versions \[1, 2, 3, 4\]"):
    opened({**sealed({}, FINGERPRINT), "version": 7}, FINGERPRINT)


def test_a_version_1_state_opens_as_the_logical_shard_of_its_process():
  # Release 0.1.0: one process's packing state, the process in the fingerprint.
  packer = {"next_index": [3], "draws": 2, "buffer": [[0, 1]], "carried": [],
            "stats": {"rows": 5}}
  old = {"version": 1, "fingerprint": {**FINGERPRINT, "process_index": 1, "process_count": 2},
         **packer}
  assert opened(old, {**FINGERPRINT, "logical_shards": 2}) == {
      "logical_shards": 2, "shards": {"1": {"rows": 5, "ended": False, "packer": packer}}}
  with pytest.raises(StateMismatchError, match="logical_shards: saved 2, now 4"):
    opened(old, {**FINGERPRINT, "logical_shards": 4})


def test_another_stream_is_refused_naming_each_field_that_differs():
  state = sealed({}, FINGERPRINT)
  with pytest.raises(StateMismatchError, match=r"config: saved 'abc', now 'xyz'; seed: saved "
                                               r"1, now 2\)"):
    opened(state, {"config": "xyz", "seed": 2})


def test_a_refused_state_leaves_the_iterator_where_it_was():
  with iter(batched(groups_of([[100] * 60]), 2)) as it:
    next(it)
    before = it.get_state()
    with pytest.raises(StateMismatchError, match="test: saved 2, now 1"):
      it.set_state({**before, "fingerprint": {"test": 2}, "next_index": [0]})
    assert it.get_state() == before


# --- every field checked before anything changes ----------------------------------------


def _saved():
  """An iterator two batches in (something buffered), and its state."""
  it = iter(batched(groups_of([[300, 200, 500, 100, 50, 400, 250] * 4, [120, 700, 80, 60] * 6]),
                    2, expected=900, buffer=4, mandatory=[False, True]))
  next(it)
  next(it)
  return it, it.get_state()


def _with(state, path, value):
  """`state` (a copy) with the entry at `path` (keys and list indices) set to `value`;
  value DELETE removes it."""
  state = json.loads(json.dumps(state))
  *parents, last = path
  target = state
  for key in parents:
    target = target[key]
  if value is DELETE:
    del target[last]
  else:
    target[last] = value
  return state


DELETE = object()
MALFORMED = {
    "missing_next_index": (("next_index",), DELETE, "`next_index` is missing"),
    "missing_draws": (("draws",), DELETE, "`draws` is missing"),
    "missing_buffer": (("buffer",), DELETE, "`buffer` is missing"),
    "missing_carried": (("carried",), DELETE, "`carried` is missing"),
    "missing_stats": (("stats",), DELETE, "`stats` is missing"),
    "missing_counter": (("stats", "rows"), DELETE, "`stats.rows` is missing"),
    "next_index_text": (("next_index",), "12", r"`next_index`: expected a list"),
    "next_index_short": (("next_index",), [3], r"`next_index`: expected 2 entries, got 1"),
    "next_index_negative": (("next_index", 0), -1, r"`next_index\[0\]`: -1 is outside"),
    "next_index_huge": (("next_index", 1), 10**30, r"`next_index\[1\]`: 10{30} is outside"),
    "next_index_float": (("next_index", 0), 2.0, r"`next_index\[0\]`: expected a whole number"),
    "draws_negative": (("draws",), -3, r"`draws`: -3 is outside"),
    "draws_bool": (("draws",), True, r"`draws`: expected a whole number"),
    "stats_list": (("stats",), [], r"`stats`: expected a mapping, got list"),
    "stats_group_unknown": (("stats", "drops", "g7"), {}, r"`stats.drops`: expected the groups"),
    "stats_count_negative": (("stats", "tokens"), -1, r"`stats.tokens`: -1 is outside"),
    "buffer_dict": (("buffer",), {"0": 1}, r"`buffer`: expected a list, got dict"),
    "buffer_entry_short": (("buffer", 0), [1], r"`buffer\[0\]`: expected 2 entries"),
    "buffer_entry_text": (("buffer", 0), "0:1", r"`buffer\[0\]`: expected a list"),
    "buffer_unknown_group": (("buffer", 0), [7, 0], r"`buffer\[0\]\[0\]`: 7 is outside \[0, 1\]"),
    "buffer_not_drawn_yet": (("buffer", 0), [0, 999], r"`buffer\[0\]\[1\]`: 999 is outside"),
    "carried_negative": (("carried",), [[1, -2]], r"`carried\[0\]\[1\]`: -2 is outside"),
}


@pytest.mark.parametrize("path,value,match", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_state_names_the_field_and_changes_nothing(path, value, match):
  it, state = _saved()
  twin, _ = _saved()
  with it, twin:
    assert state["buffer"]  # the cases above edit a buffered key
    with pytest.raises(StateMismatchError, match=match):
      it.set_state(_with(state, path, value))
    assert it.get_state() == state
    assert next(it)["sample_keys"] == next(twin)["sample_keys"]


def test_a_sample_saved_twice_is_refused():
  it, state = _saved()
  with it:
    twice = _with(state, ("carried",), [state["buffer"][0]])
    with pytest.raises(StateMismatchError, match=r"`buffer` and `carried` hold the sample "
                                                 rf"\[{state['buffer'][0][0]}, "
                                                 rf"{state['buffer'][0][1]}\] 2 times"):
      it.set_state(twice)
    assert it.get_state() == state


def test_more_buffered_keys_than_the_buffer_holds_are_refused_before_any_is_made():
  it, state = _saved()
  with it:
    flood = _with(state, ("buffer",), [[0, 0]] * 100_000)
    with pytest.raises(StateMismatchError, match=r"`buffer`: 100000 entries, at most 4"):
      it.set_state(flood)
    assert it.get_state() == state


def test_fingerprints_compare_field_by_field():
  ours = {"config": {"max_buffer_size": 16, "groups": {"vlm_sft": "aa"}}, "seed": 1}
  saved = {"config": {"max_buffer_size": 8, "groups": {"vlm_sft": "bb"}}, "seed": 1}
  with pytest.raises(StateMismatchError, match=r"grouped_datasets.vlm_sft: saved 'bb', now 'aa'; "
                                               r"config.max_buffer_size: saved 8, now 16\)"):
    opened(sealed({}, saved), ours)
