"""The state's envelope: version and fingerprint checked before anything is restored."""

import pytest

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.state import STATE_VERSION, opened, sealed
from packer_samples import batched, groups_of

FINGERPRINT = {"config": "abc", "seed": 1}


def test_sealed_then_opened_gives_the_stages_state_back():
  inner = {"next_index": [3], "draws": 2, "buffer": [], "carried": [], "stats": {}}
  state = sealed(inner, FINGERPRINT)
  assert list(state)[:2] == ["version", "fingerprint"] and state["version"] == STATE_VERSION
  assert opened(state, FINGERPRINT) == inner


def test_another_version_is_refused():
  with pytest.raises(StateMismatchError, match="version 7; this bagel_grain reads version 2"):
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
