"""The packer's rules and invariants on synthetic groups (no decoding involved)."""

import collections
import dataclasses

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from bagel_grain.errors import GroupExhaustedError, StateMismatchError
from bagel_grain.packing.layout import Geometry, SpecialTokens, layout_sample
from bagel_grain.packing.mixpack import MixPackIterator, PackingSpec
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.row import Capacities
from bagel_grain.drops import Dropped
from bagel_grain.sample import PlanItem, SampleKey

GEOMETRY = Geometry(vit_patch_size=14, vae_downsample=16, max_num_patch_per_side=70,
                    max_latent_size=32, interpolate_pos=False)
SPECIAL = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)


def make_sample(group, index, text_len, *, vae=False, vit=False, drop_reason=None):
  """A prepared sample of `text_len` text tokens, optionally with a 32x32 VAE / 28x28 ViT image."""
  key = SampleKey(group, index, 0, f"g{group}:{index}")
  if drop_reason:
    return Dropped(drop_reason, key=key)
  plan, texts, images = [PlanItem("text", loss=1)], [np.arange(text_len, dtype=np.int32) + 10], []
  if vit:
    plan.insert(0, PlanItem("vit_image"))
    images.insert(0, np.full((28, 28, 3), 7, np.uint8))
  if vae:
    plan.append(PlanItem("vae_image", loss=1))
    images.append(np.full((32, 32, 3), 9, np.uint8))
  timesteps = (0.5,) if vae else ()
  layout = layout_sample(plan, texts, images, cfg_drops=(), timesteps=timesteps,
                         geometry=GEOMETRY, special=SPECIAL)
  num_tokens = text_len + 4 * vit + 4 * vae
  return PreparedSample(key, num_tokens + 2 * len(plan), layout)


def spec_for(groups, *, weights=None, mandatory=None, expected=900, max_tokens=1024,
             per_sample=1000, prefer=400, buffer=4, caps=None, max_drops=50, seed=0):
  n = len(groups)
  caps = caps or Capacities(tokens=1024, vit_patches=1024, vae_tokens=1024, vae_images=8,
                            vae_image_size=32, splits=512)
  return PackingSpec(
      group_names=tuple(f"g{i}" for i in range(n)), weights=tuple(weights or [1.0] * n),
      mandatory=tuple(mandatory or [False] * n), records_per_epoch=tuple(len(g) for g in groups),
      expected_num_tokens=expected, max_num_tokens=max_tokens, max_num_tokens_per_sample=per_sample,
      prefer_buffer_before=prefer, max_buffer_size=buffer, capacities=caps, seed=seed,
      process_index=0, max_consecutive_drops=max_drops, fingerprint={"test": 1})


def run(groups, spec, rows=None):
  it = MixPackIterator(groups, spec)
  out = []
  for row in it:
    out.append(row)
    if rows is not None and len(out) == rows:
      break
  return it, out


def assert_accounting(it, rows):
  stats = it.stats()
  assert stats["drawn"] == stats["packed"] + stats["dropped"] + stats["buffered"] + stats["carried"]
  keys = [k for row in rows for k in row["sample_keys"]]
  assert len(keys) == len(set(keys)) == stats["packed"]


group_sizes = st.lists(st.integers(1, 700), min_size=1, max_size=40)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(sizes=st.lists(group_sizes, min_size=1, max_size=3),
                  mandatory=st.lists(st.booleans(), min_size=3, max_size=3),
                  expected=st.integers(100, 1024), buffer=st.integers(0, 5),
                  prefer=st.integers(0, 1024), images=st.booleans())
def test_invariants_on_random_streams(sizes, mandatory, expected, buffer, prefer, images):
  groups = [[make_sample(g, i, n, vae=images and i % 2 == 0, vit=images and i % 3 == 0)
             for i, n in enumerate(group)] for g, group in enumerate(sizes)]
  spec = spec_for(groups, mandatory=mandatory[:len(groups)], expected=expected, buffer=buffer,
                  prefer=prefer, per_sample=600)
  it, rows = run(groups, spec)
  by_key = {s.key.record: s for g in groups for s in g}
  for row in rows:
    members = [by_key[k[3]] for k in row["sample_keys"]]
    # Within the token budget by upstream's estimate, hence within L too.
    assert sum(s.packed_size for s in members) <= spec.max_num_tokens
    assert int(row["num_tokens"]) == sum(s.layout.num_tokens for s in members)
    assert int(row["num_vae_tokens"]) <= spec.capacities.vae_tokens
    assert int((row["vae_image_hw"][:, 0] > 0).sum()) <= spec.capacities.vae_images
    # Each group's samples appear in index order (per-group streams are consumed in order).
  packed = [k for row in rows for k in row["sample_keys"]]
  for g in range(len(groups)):
    idx = [k[1] for k in packed if k[0] == f"g{g}"]
    assert sorted(idx) == sorted(set(idx))
  # Finite groups: at the end nothing is left buffered or carried, every sample is
  # packed or dropped for being over the per-sample limit.
  stats = it.stats()
  assert stats["buffered"] == stats["carried"] == 0
  assert_accounting(it, rows)
  over = sum(s.packed_size > 600 for g in groups for s in g)
  assert stats["dropped"] == over
  assert stats["packed"] == sum(len(g) for g in groups) - over


def test_three_mandatory_groups_never_overflow_and_lose_nothing():
  # Upstream overflows max_num_tokens here (4096/5120/4096 with three mandatory groups).
  rng = np.random.default_rng(0)
  groups = [[make_sample(g, i, int(n)) for i, n in enumerate(rng.integers(500, 3000, 60))]
            for g in range(3)]
  caps = Capacities(tokens=5120, vit_patches=5120, vae_tokens=5120, vae_images=4,
                    vae_image_size=32, splits=2560)
  spec = spec_for(groups, mandatory=[True] * 3, expected=4096, max_tokens=5120,
                  per_sample=4096, prefer=2048, buffer=50, caps=caps)
  it, rows = run(groups, spec, rows=40)
  by_key = {s.key.record: s for g in groups for s in g}
  for row in rows:
    assert sum(by_key[k[3]].packed_size for k in row["sample_keys"]) <= 5120
  assert_accounting(it, rows)
  stats = it.stats()
  missing = sum(stats["missing_mandatory"].values())
  lacking = sum(1 for row in rows for g in ("g0", "g1", "g2")
                if g not in {k[0] for k in row["sample_keys"]})
  assert missing == lacking > 0  # mandatory samples were carried, and counted


def test_full_buffer_loses_no_sample():
  # Upstream discards the sample in hand when its buffer is full; we carry it.
  groups = [[make_sample(0, i, 300 + 50 * (i % 7)) for i in range(200)],
            [make_sample(1, i, 700) for i in range(200)]]
  spec = spec_for(groups, expected=1000, max_tokens=1024, buffer=1, prefer=0)
  it, rows = run(groups, spec)
  assert_accounting(it, rows)
  assert it.stats()["packed"] == 400 and it.stats()["dropped"] == 0


def test_carried_sample_starts_the_next_row():
  groups = [[make_sample(0, i, n) for i, n in enumerate([600, 600, 100, 100])]]
  spec = spec_for(groups, expected=1000, max_tokens=1024, buffer=0, prefer=0)
  _, rows = run(groups, spec)
  assert [[k[1] for k in row["sample_keys"]] for row in rows] == [[0], [1, 2, 3]]


def test_prefer_buffer_before_takes_the_buffered_sample_and_carries_it():
  # Sizes (+2 markers each): 502, 602, 302, 202, 52; budget 1024, close at 1000.
  groups = [[make_sample(0, i, n) for i, n in enumerate([500, 600, 300, 200, 50])]]
  spec = spec_for(groups, expected=1000, max_tokens=1024, buffer=4, prefer=900)
  _, rows = run(groups, spec)
  # Row 1: 0 fits; 1 does not -> buffered; below `prefer` the buffer is served
  # first, 1 still does not fit -> carried (upstream loses it here), row closes.
  # Row 2: carried 1, then 2 (904); 3 does not fit -> buffered; 4 fits (956); the
  # groups are exhausted, so the buffer drains: 3 does not fit -> carried.
  assert [[k[1] for k in row["sample_keys"]] for row in rows] == [[0], [1, 2, 4], [3]]


def test_mandatory_group_appears_in_every_row():
  groups = [[make_sample(0, i, 100) for i in range(400)],
            [make_sample(1, i, 50) for i in range(400)]]
  spec = spec_for(groups, weights=[1.0, 0.0], mandatory=[False, True], expected=900)
  _, rows = run(groups, spec, rows=20)
  assert all(any(k[0] == "g1" for k in row["sample_keys"]) for row in rows)
  # Weight 0: only the mandatory sample of g1 per row.
  assert all(sum(k[0] == "g1" for k in row["sample_keys"]) == 1 for row in rows)


def test_weighted_shares_follow_weights():
  groups = [[make_sample(g, i, 20) for i in range(20000)] for g in range(3)]
  spec = spec_for(groups, weights=[1.0, 2.0, 5.0], expected=1000)
  it, rows = run(groups, spec, rows=60)
  counts = collections.Counter(k[0] for row in rows for k in row["sample_keys"])
  total = sum(counts.values())
  for g, w in zip(("g0", "g1", "g2"), (1 / 8, 2 / 8, 5 / 8)):
    assert abs(counts[g] / total - w) < 0.04


def test_dropped_markers_are_counted_and_replaced_from_the_same_group():
  groups = [[make_sample(0, i, 100, drop_reason="bad_image" if i % 3 == 0 else None)
             for i in range(90)]]
  spec = spec_for(groups, expected=900)
  it, rows = run(groups, spec)
  stats = it.stats()
  assert stats["drops"]["g0"] == {"bad_image": 30}
  assert stats["packed"] == 60
  assert_accounting(it, rows)


def test_group_of_only_bad_records_is_an_error_naming_it():
  groups = [[make_sample(0, i, 100) for i in range(100)],
            [make_sample(1, i, 0, drop_reason="bad_json") for i in range(100)]]
  spec = spec_for(groups, mandatory=[False, True], max_drops=20)
  with pytest.raises(GroupExhaustedError, match=r"'g1'.*bad_json: 20"):
    run(groups, spec, rows=1)


def test_sample_over_a_capacity_is_dropped_with_its_reason():
  caps = Capacities(tokens=1024, vit_patches=1024, vae_tokens=1024, vae_images=1,
                    vae_image_size=16, splits=512)  # 32x32 VAE images cannot fit S=16
  groups = [[make_sample(0, i, 50, vae=i % 2 == 0) for i in range(20)]]
  spec = spec_for(groups, caps=caps)
  it, rows = run(groups, spec)
  assert it.stats()["drops"]["g0"] == {"over_row_capacity_vae_image_size": 10}
  assert_accounting(it, rows)


def test_state_round_trip_continues_identically():
  rng = np.random.default_rng(3)
  groups = [[make_sample(g, i, int(n)) for i, n in enumerate(rng.integers(50, 700, 300))]
            for g in range(2)]
  spec = spec_for(groups, mandatory=[True, False], buffer=3, prefer=500)
  reference = [row["sample_keys"] for row in run(groups, spec, rows=40)[1]]
  for k in (0, 1, 7, 20):
    it = MixPackIterator(groups, spec)
    for _ in range(k):
      next(it)
    state = it.get_state()
    resumed = MixPackIterator(groups, spec)
    resumed.set_state(state)
    assert [next(resumed)["sample_keys"] for _ in range(40 - k)] == reference[k:]


def test_state_from_another_stream_is_refused():
  groups = [[make_sample(0, i, 100) for i in range(50)]]
  it = MixPackIterator(groups, spec_for(groups))
  next(it)
  state = it.get_state()
  other = dataclasses.replace(spec_for(groups), fingerprint={"test": 2})
  with pytest.raises(StateMismatchError, match="test: saved 1, now 2"):
    MixPackIterator(groups, other).set_state(state)


def test_group_mostly_bad_over_a_window_is_an_error():
  # 19 of every 20 records are bad: never 20 bad in a row, but the window sees it.
  groups = [[make_sample(0, i, 50, drop_reason=None if i % 20 == 0 else "bad_image")
             for i in range(2000)]]
  spec = dataclasses.replace(spec_for(groups, max_drops=1000), bad_record_window=100,
                             max_bad_ratio=0.9)
  with pytest.raises(GroupExhaustedError, match=r"'g0': 95 of its last 100 .*bad_image: 95"):
    run(groups, spec)


def test_occasional_bad_records_pass_the_window_check():
  groups = [[make_sample(0, i, 50, drop_reason="bad_image" if i % 2 else None)
             for i in range(400)]]
  spec = dataclasses.replace(spec_for(groups), bad_record_window=50, max_bad_ratio=0.6)
  it, rows = run(groups, spec)
  assert it.stats()["drops"]["g0"] == {"bad_image": 200}
