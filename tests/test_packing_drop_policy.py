"""The drop policy: why an element cannot be packed, and when a group's bad records stop."""

import collections

import pytest

from bagel_grain.drops import DropReason
from bagel_grain.errors import GroupExhaustedError
from bagel_grain.packing.drop_policy import BadRecordLimits, DropPolicy
from bagel_grain.packing.row import Capacities
from packer_samples import CAPS, make_sample, mixed, packed
from resume import take

POLICY = DropPolicy(max_num_tokens_per_sample=300, capacities=CAPS, max_consecutive_drops=3,
                    bad_record_window=4, max_bad_ratio=0.5)


def test_reason_of_each_kind_of_element():
  assert POLICY.reason(make_sample(0, 0, 50)) is None
  assert POLICY.reason(make_sample(0, 0, 50, drop_reason="bad_json")) == DropReason.BAD_JSON
  assert POLICY.reason(make_sample(0, 0, 299)) == DropReason.OVER_MAX_TOKENS_PER_SAMPLE
  small = Capacities(tokens=1024, vit_patches=1024, vae_tokens=1024, vae_images=1,
                     vae_image_size=16, splits=512)  # 32x32 VAE images cannot fit S=16
  policy = DropPolicy(max_num_tokens_per_sample=300, capacities=small, max_consecutive_drops=3)
  assert (policy.reason(make_sample(0, 0, 50, vae=True))
          == DropReason.OVER_ROW_CAPACITY_VAE_IMAGE_SIZE)


def test_consecutive_drops_stop_the_group_naming_it_and_its_reasons():
  limits = BadRecordLimits(POLICY, ["t2i", "vlm"])
  bad = collections.Counter({DropReason.BAD_JSON: 2})
  limits.check_consecutive(1, bad, "a.jsonl:3")
  bad[DropReason.BAD_TURN] += 1
  with pytest.raises(GroupExhaustedError,
                     match=r"'vlm' yielded no usable sample in 3 consecutive records \(top "
                           r"reasons: bad_json: 2, bad_turn: 1; last record: a.jsonl:4\)"):
    limits.check_consecutive(1, bad, "a.jsonl:4")


def test_a_window_mostly_bad_stops_the_group():
  limits = BadRecordLimits(POLICY, ["t2i"])
  for reason in (None, DropReason.BAD_IMAGE, None):
    limits.check_window(0, reason, "x")  # the window is not full yet
  limits.check_window(0, DropReason.BAD_IMAGE, "x")  # 2 of 4: not over half
  with pytest.raises(GroupExhaustedError, match=r"'t2i': 3 of its last 4 records"):
    limits.check_window(0, DropReason.BAD_IMAGE, "x")


def test_group_of_only_bad_records_is_an_error_naming_it():
  groups = [[make_sample(0, i, 100) for i in range(100)],
            [make_sample(1, i, 0, drop_reason="bad_json") for i in range(100)]]
  with pytest.raises(GroupExhaustedError, match=r"'g1'.*bad_json: 20"):
    with iter(packed(groups, mandatory=[False, True], max_drops=20)) as it:
      next(it)


def test_group_mostly_bad_over_a_window_is_an_error():
  # 19 of every 20 records are bad: never 20 bad in a row, but the window sees it.
  groups = [[make_sample(0, i, 50, drop_reason=None if i % 20 == 0 else "bad_image")
             for i in range(2000)]]
  with pytest.raises(GroupExhaustedError, match=r"'g0': 95 of its last 100 .*bad_image: 95"):
    with iter(mixed(groups, max_drops=1000, window=100, max_bad_ratio=0.9)) as it:
      list(it)


def test_occasional_bad_records_pass_the_window_check():
  groups = [[make_sample(0, i, 50, drop_reason="bad_image" if i % 2 else None)
             for i in range(400)]]
  with iter(mixed(groups, window=50, max_bad_ratio=0.6)) as it:
    assert len(list(it)) == 200
    stats = it.get_state()["stats"]
    assert dict(zip(stats["drop_reasons"], stats["drops"]["g0"]))["bad_image"] == 200
    assert sum(stats["drops"]["g0"]) == 200


def test_sample_over_a_capacity_is_dropped_with_its_reason():
  caps = Capacities(tokens=1024, vit_patches=1024, vae_tokens=1024, vae_images=1,
                    vae_image_size=16, splits=512)
  groups = [[make_sample(0, i, 50, vae=i % 2 == 0) for i in range(20)]]
  with iter(packed(groups, caps=caps)) as it:
    rows = take(it, 100)
    assert it.stats()["drops"]["g0"] == {"over_row_capacity_vae_image_size": 10}
  assert sum(len(row) for row in rows) == 10
