"""The stages' counters: each counts its own, the state keeps them in one layout."""

import pytest

from bagel_grain.drops import DropReason, Note
from bagel_grain.errors import StateMismatchError
from bagel_grain.packing import stats
from bagel_grain.packing.stats import DrawCounts, RowCounts

NAMES = ("t2i", "vlm")


def counted():
  draws, rows = DrawCounts(NAMES), RowCounts(NAMES)
  draws.drawn(0, image_tokens=100)
  draws.drawn(0, image_tokens=50)
  draws.drawn(1)
  draws.dropped(1, DropReason.BAD_JSON)
  draws.noted(0, ["empty_caption"])
  rows.row([0, 0], tokens=300, missing=[1])
  return draws, rows


# The sparse layout of state versions 1 and 2: only what is non-zero.
SPARSE = {"rows": 1, "tokens": 300, "image_tokens": 150,
          "counts": {"t2i": {"drawn": 2, "packed": 2}, "vlm": {"drawn": 1}},
          "drops": {"t2i": {}, "vlm": {"bad_json": 1}},
          "notes": {"t2i": {"empty_caption": 1}, "vlm": {}},
          "missing_mandatory": {"vlm": 1}}


def test_the_state_layout_holds_every_group_reason_and_note():
  draws, rows = counted()
  state = stats.merged(draws.to_json(), rows.to_json())
  assert state["counts"] == {"t2i": {"drawn": 2, "packed": 2}, "vlm": {"drawn": 1, "packed": 0}}
  assert state["missing_mandatory"] == {"t2i": 0, "vlm": 1}
  assert state["drop_reasons"] == [r.value for r in DropReason]
  for name in NAMES:
    assert len(state["drops"][name]) == len(DropReason)
    assert list(state["notes"][name]) == [n.value for n in Note]
  vlm = dict(zip(state["drop_reasons"], state["drops"]["vlm"]))
  assert vlm["bad_json"] == 1 and sum(vlm.values()) == 1
  assert state["notes"]["t2i"] == {"empty_caption": 1, "unused_images": 0,
                                   "unfilled_placeholders": 0}
  assert stats.report(state)["drops"] == SPARSE["drops"]  # reports stay sparse


def test_the_sparse_layout_of_earlier_versions_reads_back():
  draws, rows = counted()
  assert DrawCounts.from_json(NAMES, SPARSE).to_json() == draws.to_json()
  assert RowCounts.from_json(NAMES, SPARSE).to_json() == rows.to_json()


@pytest.mark.parametrize("field", ["drops", "notes"])
def test_unknown_reasons_and_notes_are_refused_naming_a_few(field):
  # A made-up state of 39 MB once made get_state() return it all and stats() take 7 s.
  made_up = {f"reason_{i}": 1 for i in range(100_000)}
  state = {**SPARSE, field: {"t2i": made_up, "vlm": {}}}
  with pytest.raises(StateMismatchError, match=rf"`stats.{field}.t2i`: 100000 unknown names "
                                               r"\('reason_0', .*, \.\.\.\)"):
    DrawCounts.from_json(NAMES, state)


def test_each_stage_reads_its_own_counters_back():
  draws, rows = counted()
  state = stats.merged(draws.to_json(), rows.to_json())
  assert DrawCounts.from_json(NAMES, state).to_json() == draws.to_json()
  assert RowCounts.from_json(NAMES, state).to_json() == rows.to_json()


def test_report_adds_totals():
  draws, rows = counted()
  report = stats.report(stats.merged(draws.to_json(), rows.to_json()))
  assert (report["drawn"], report["packed"], report["dropped"]) == (3, 2, 1)
  assert report["drops_by_reason"] == {"bad_json": 1}


def test_drop_counts_are_read_in_the_order_the_state_names():
  draws, rows = counted()
  state = stats.merged(draws.to_json(), rows.to_json())
  reordered = {**state, "drop_reasons": state["drop_reasons"][::-1],
               "drops": {k: v[::-1] for k, v in state["drops"].items()}}
  assert DrawCounts.from_json(NAMES, reordered).to_json() == draws.to_json()
  with pytest.raises(StateMismatchError, match="unknown names .'made_up'"):
    DrawCounts.from_json(NAMES, {**state, "drop_reasons": ["made_up"] + state["drop_reasons"][1:]})
  with pytest.raises(StateMismatchError, match=r"`stats.drops.t2i`: expected \d+ entries"):
    DrawCounts.from_json(NAMES, {**state, "drops": {**state["drops"], "t2i": [0]}})
