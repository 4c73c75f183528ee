"""The stages' counters: each counts its own, the state keeps them in one layout."""

from bagel_grain.drops import DropReason
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


def test_the_state_layout_of_both_stages():
  draws, rows = counted()
  # The layout states have always had: a checkpoint of an earlier release reads back.
  assert stats.merged(draws.to_json(), rows.to_json()) == {
      "rows": 1, "tokens": 300, "image_tokens": 150,
      "counts": {"t2i": {"drawn": 2, "packed": 2}, "vlm": {"drawn": 1}},
      "drops": {"t2i": {}, "vlm": {"bad_json": 1}},
      "notes": {"t2i": {"empty_caption": 1}, "vlm": {}},
      "missing_mandatory": {"vlm": 1}}


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
