"""One resume check for the packer's stages and the pipeline.

Like Grain's `assert_equal_output_after_checkpoint`: an uninterrupted run saves
its state before every element; a fresh iterator restored from any of them
reports the same state back and yields the same elements from there on.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from bagel_grain.packing.prepare import PreparedSample


def take(it: Iterator, n: int) -> list:
  """Up to `n` elements (fewer at the end of a finite stream)."""
  out = []
  for _ in range(n):
    try:
      out.append(next(it))
    except StopIteration:
      break
  return out


def as_saved(state: dict[str, Any]) -> dict[str, Any]:
  """The state as a checkpoint stores it: plain JSON."""
  return json.loads(json.dumps(state))


def assert_same_elements(got: Sequence, want: Sequence) -> None:
  """Batches: the same arrays, bit for bit, and sample keys; samples: the same keys."""
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    if isinstance(b, dict):
      assert a.keys() == b.keys(), i
      for name in b:
        if isinstance(b[name], np.ndarray):
          np.testing.assert_array_equal(a[name], b[name], err_msg=f"element {i}: {name}")
        else:
          assert a[name] == b[name], (i, name)
    else:
      assert _keys(a) == _keys(b), i


def _keys(element):
  if isinstance(element, PreparedSample):
    return element.key
  return tuple(_keys(e) for e in element)


def assert_resumes_identically(make: Callable[[], Any], *, steps: int, at: Sequence[int],
                               make_restored: Callable[[], Any] | None = None,
                               max_state_bytes: int | None = None) -> list:
  """Restores at each element index in `at` of a `steps`-element run; returns the run.

  `make` opens the iterator of the uninterrupted run, `make_restored` (default:
  `make`) the iterators that restore, e.g. with another worker count.
  """
  states, elements = [], []
  with make() as it:
    for _ in range(steps):
      states.append(as_saved(it.get_state()))
      try:
        elements.append(next(it))
      except StopIteration:
        states.pop()
        break
  for k in at:
    if max_state_bytes is not None:
      assert len(json.dumps(states[k])) <= max_state_bytes
    with (make_restored or make)() as restored:
      restored.set_state(states[k])
      assert as_saved(restored.get_state()) == states[k], f"state {k} not restored as saved"
      assert_same_elements(take(restored, len(elements) - k), elements[k:])
  return elements
