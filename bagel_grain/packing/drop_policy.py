"""Which drawn elements cannot be packed, and when a group's bad records stop the stream.

A record that did not become a sample, a sample over `max_num_tokens_per_sample`
and a sample over a row capacity are counted under their reason and replaced by
the group's next element. A group that keeps yielding nothing usable stops the
stream with an error naming it, rather than being drawn from forever.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from bagel_grain.drops import Dropped, DropReason
from bagel_grain.errors import GroupExhaustedError
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.row import Capacities


@dataclasses.dataclass(frozen=True)
class DropPolicy:
  """The limits a drawn element and its group are held to."""

  max_num_tokens_per_sample: int
  capacities: Capacities
  max_consecutive_drops: int
  bad_record_window: int = 200
  max_bad_ratio: float = 0.9

  def reason(self, element: PreparedSample | Dropped) -> DropReason | None:
    """Why `element` cannot be packed; None when it can."""
    if isinstance(element, Dropped):
      return element.reason
    if element.packed_size > self.max_num_tokens_per_sample:
      return DropReason.OVER_MAX_TOKENS_PER_SAMPLE
    over = self.capacities.overflows(element.usage)
    return DropReason.over_row_capacity(over[0]) if over else None


_BLANK_HINT = " (remove the blank lines: sed -i '/^[[:space:]]*$/d' FILE)"


def _top(reasons: collections.Counter) -> str:
  return ", ".join(f"{r}: {n}" for r, n in reasons.most_common(3))


class BadRecordLimits:
  """Per group, the outcomes of its latest records, checked against the policy's limits.

  The window is not part of the iterator state: after a restore it fills again.
  """

  def __init__(self, policy: DropPolicy, group_names: Sequence[str],
               windows: Sequence[Sequence[DropReason | None]] = ()):
    self._policy = policy
    self._names = tuple(group_names)
    windows = windows or [()] * len(self._names)
    self._recent = [collections.deque(w, maxlen=policy.bad_record_window) for w in windows]

  def windows(self) -> tuple[tuple[DropReason | None, ...], ...]:
    """The outcomes in each group's window, by value (to start again from them)."""
    return tuple(tuple(recent) for recent in self._recent)

  def check_window(self, group: int, reason: DropReason | None, record: str) -> None:
    """Stops a group whose latest `bad_record_window` records are mostly bad."""
    if reason == DropReason.BLANK_LINE:  # not a bad record: a gap in the file
      return
    recent, policy = self._recent[group], self._policy
    recent.append(reason)
    if len(recent) < recent.maxlen:
      return
    if len(recent) - recent.count(None) > policy.max_bad_ratio * len(recent):
      bad = collections.Counter(r for r in recent if r is not None)
      raise GroupExhaustedError(
          f"group {self._names[group]!r}: {sum(bad.values())} of its last {len(recent)} "
          f"records were dropped (top reasons: {_top(bad)}; last record: {record}). Fix the "
          "data, or raise `max_bad_ratio` / `bad_record_window`.")

  def check_consecutive(self, group: int, bad: collections.Counter, record: str) -> None:
    """Stops a group once `bad` (its drops since its last usable sample) reaches the limit."""
    limit = self._policy.max_consecutive_drops
    if sum(bad.values()) >= limit:
      raise GroupExhaustedError(
          f"group {self._names[group]!r} yielded no usable sample in {limit} consecutive "
          f"records (top reasons: {_top(bad)}; last record: {record}). Fix the data"
          f"{_BLANK_HINT if bad.most_common(1)[0][0] == DropReason.BLANK_LINE else ''}, "
          "or raise `max_consecutive_drops`.")
