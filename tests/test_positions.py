"""2-D patch position ids against upstream's goldens."""

import numpy as np
import pytest

from bagel_grain.packing.positions import flattened_position_ids
from golden import load_json

_DOC = load_json("position_ids.json")


@pytest.mark.parametrize("case", _DOC["cases"],
                         ids=lambda c: f"{c['h']}x{c['w']}_p{c['patch']}_M{c['max_per_side']}")
@pytest.mark.parametrize("interpolate", [False, True])
def test_position_ids_match_golden(case, interpolate):
  got = flattened_position_ids(case["h"], case["w"], case["patch"], case["max_per_side"],
                               interpolate=interpolate)
  want = case["interpolate" if interpolate else "extrapolate"]
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.asarray(want, dtype=np.int32))


def test_interpolate_axis_buckets_match_golden():
  wrong = []
  for e in _DOC["interpolate_axis_buckets"]:
    n, m = e["n"], e["max_per_side"]
    # A 1-patch-wide column of n patches exposes the row buckets: id = bucket * M + 0.
    got = flattened_position_ids(n, 1, 1, m, interpolate=True) // m
    if got.tolist() != e["buckets"]:
      wrong.append((n, m))
  assert len(_DOC["interpolate_axis_buckets"]) == 190
  assert not wrong, f"mismatched (n, M): {wrong}"


def test_cached_result_is_read_only():
  ids = flattened_position_ids(64, 64, 16, 32, interpolate=True)
  assert ids is flattened_position_ids(64, 64, 16, 32, interpolate=True)
  with pytest.raises(ValueError):
    ids[0] = 1


def test_extrapolate_is_row_major():
  ids = flattened_position_ids(3 * 14, 5 * 14, 14, 70, interpolate=False)
  assert ids.tolist() == [r * 70 + c for r in range(3) for c in range(5)]
