"""A draw's uniform worked out in Python is numpy's, bit for bit."""

import numpy as np
from hypothesis import given, settings, strategies as st

from bagel_grain.packing import draw_key

WORD = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1]))


@settings(max_examples=2000, deadline=None)
@given(a=WORD, b=WORD, c=WORD, d=WORD)
def test_the_uniform_of_four_words_is_numpys(a, b, c, d):
  assert draw_key.uniform(a, b, c, d) == np.random.default_rng([a, b, c, d]).random()


def test_the_draws_of_one_key_prefix_are_numpys():
  # The pool of the first three numbers is worked out once: every draw after it still
  # matches (the mixing order of the fourth word with it).
  for seed in (0, 7, 2**32 - 1):
    for draw in range(300):
      want = np.random.default_rng([seed, 0xD7A3, 3, draw]).random()
      assert draw_key.uniform(seed, 0xD7A3, 3, draw) == want
