"""Group weights as the weighted draw uses them: shares of their sum.

Only the ratios of the weights matter: `[5, 2, 3]` and `[0.5, 0.2, 0.3]` draw the
same groups. A saved state compares weights by `same_draws`, so a config that
scales every weight restores; "the same" is decided on the very floats the draw
computes (the cumulative shares of every set of groups that may be active at
once), never within a tolerance, so a restore that passes is bit-identical.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

# Beyond this many groups of non-zero weight, the 2**n sets of groups that may be active
# are too many to compare: weights must then be saved and given exactly alike.
MAX_COMPARED_GROUPS = 12


def cumulative_shares(weights: Sequence[float], active: Sequence[bool]) -> np.ndarray:
  """Each group's upper bound in [0, 1] of a draw among the `active` groups."""
  w = np.where(active, weights, 0.0)
  return np.cumsum(w) / w.sum()


def same_draws(saved: Sequence[float], ours: Sequence[float]) -> bool:
  """Whether two weightings draw the same group for every draw, whichever groups are still
  active (groups run out in a finite stream)."""
  if list(saved) == list(ours):
    return True
  positive = [i for i, w in enumerate(saved) if w > 0]
  if (len(saved) != len(ours) or positive != [i for i, w in enumerate(ours) if w > 0]
      or len(positive) > MAX_COMPARED_GROUPS):
    return False
  for chosen in itertools.product((False, True), repeat=len(positive)):
    if not any(chosen):
      continue
    active = [False] * len(saved)
    for i, on in zip(positive, chosen):
      active[i] = on
    if not np.array_equal(cumulative_shares(saved, active), cumulative_shares(ours, active)):
      return False
  return True
