"""Upstream's random frame sampler: one frame per interval, padding, the permutation fallback."""

import numpy as np
import pytest

from bagel_grain.drops import Drop
from bagel_grain.families.video import sample_frame_indices


def test_frame_indices_one_per_interval():
  counts = set()
  for seed in range(200):
    indices = sample_frame_indices(100, 8, 12, np.random.default_rng(seed))
    counts.add(len(indices))
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    assert all(0 <= i < 100 for i in indices)
  assert counts == set(range(8, 13))
  for seed in range(50):
    # 10 frames of 100: interval k is [10k, 10k + 10), upstream draws from range(10k, 10k + 9).
    indices = sample_frame_indices(100, 10, 10, np.random.default_rng(seed))
    assert all(10 * k <= i <= 10 * k + 8 for k, i in enumerate(indices))


def test_short_clip_is_padded_with_its_last_frame():
  for seed in range(10):
    assert sample_frame_indices(3, 5, 5, np.random.default_rng(seed)) == [0, 1, 2, 2, 2]
  assert sample_frame_indices(8, 8, 8, np.random.default_rng(0)) == list(range(8))


def test_a_video_without_frames_is_a_bad_record():
  with pytest.raises(Drop) as info:
    sample_frame_indices(0, 4, 6, np.random.default_rng(0))
  assert info.value.reason == "video_unreadable"


def test_too_short_intervals_fall_back_to_a_sorted_permutation():
  # 8 of 12 frames: linspace gives bounds 0,1,3,4,6,7,9,10,12, so interval [0, 0) is empty.
  seen = set()
  for seed in range(60):
    indices = sample_frame_indices(12, 8, 8, np.random.default_rng(seed))
    assert len(indices) == 8 and indices == sorted(set(indices))
    seen.update(indices)
  assert seen == set(range(12))  # per-interval draws could never pick frame 11
