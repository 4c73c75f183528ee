"""Drop reasons: one enum whose values are the stats keys, one carrier that bounds its detail."""

import json
import pickle

import pytest

from bagel_grain.drops import Drop, Dropped, DropReason, require
from bagel_grain.images import ImageError
from bagel_grain.packing.row import Capacities, Usage
from bagel_grain.packing import stats
from bagel_grain.packing.stats import DrawCounts, RowCounts
from bagel_grain.sample import SampleKey


def test_a_reason_counts_and_serialises_as_its_plain_name():
  counts = {DropReason.BAD_JSON: 2}
  assert counts == {"bad_json": 2}  # stats restored from JSON merge with live counters
  assert json.dumps(counts) == '{"bad_json": 2}'
  assert f"{DropReason.MISSING_FILE}" == "missing_file"


def test_stats_report_a_reason_under_its_plain_name():
  draws = DrawCounts(["g"])
  draws.dropped(0, DropReason.BAD_JSON)
  report = stats.report(stats.merged(draws.to_json(), RowCounts(["g"]).to_json()))
  assert [type(k) for k in report["drops_by_reason"]] == [str]
  assert repr(report["drops"]) == "{'g': {'bad_json': 1}}"  # what `bagel-grain demo` prints


def test_dropped_keeps_a_short_detail():
  long = "a/" * 500
  assert Dropped(DropReason.MISSING_FILE, long).detail == long[:200]
  assert Dropped(DropReason.MISSING_FILE, "a.png").detail == "a.png"


def test_dropped_refuses_a_reason_that_is_not_a_member():
  with pytest.raises(ValueError):
    Dropped("disk_on_fire")
  assert Dropped("bad_json").reason is DropReason.BAD_JSON


def test_a_source_drop_is_placed_in_the_stream_by_its_key():
  unkeyed = Dropped(DropReason.CORRUPT_RECORD, "bad magic")
  key = SampleKey(group=1, index=7, epoch=0, record="x.array_record:3")
  placed = unkeyed.at(key)
  assert (placed.reason, placed.detail, placed.key) == (DropReason.CORRUPT_RECORD, "bad magic",
                                                         key)
  assert unkeyed.key is None


def test_require_raises_the_drop_it_names():
  require(True, DropReason.BAD_TURN)
  with pytest.raises(Drop) as e:
    require(False, DropReason.BAD_TURN, "turn 2")
  assert e.value.dropped == Dropped(DropReason.BAD_TURN, "turn 2")
  assert str(e.value) == "bad_turn: turn 2"


def test_an_image_error_is_a_drop_with_an_image_reason():
  e = ImageError(DropReason.TRUNCATED_IMAGE, "image file is truncated")
  assert isinstance(e, Drop) and e.dropped.detail == "image file is truncated"
  with pytest.raises(ValueError):
    ImageError(DropReason.BAD_JSON)


def test_drops_survive_pickling_for_worker_processes():
  for error in (Drop(DropReason.MISSING_FILE, "a.png"), ImageError(DropReason.BAD_IMAGE, "x")):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and again.dropped == error.dropped
  marker = Dropped(DropReason.BAD_JSON, "line 1", SampleKey(0, 1, 0, "a.jsonl:1"))
  assert pickle.loads(pickle.dumps(marker)) == marker


def test_every_row_capacity_the_packer_checks_has_a_reason():
  capacities = Capacities(tokens=128, vit_patches=0, vae_tokens=0, vae_images=0,
                          vae_image_size=0, splits=0)
  over = capacities.overflows(Usage(tokens=129, vit_patches=1, vae_tokens=1, vae_images=1,
                                    splits=1, vae_image_size=1))
  assert len(over) == 6
  reasons = {DropReason.over_row_capacity(name) for name in over}
  assert {r.value for r in reasons} == {f"over_row_capacity_{name}" for name in over}
