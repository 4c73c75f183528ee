"""The packer's counters: what was drawn, packed and dropped, per group and reason."""

from __future__ import annotations

import collections
from typing import Any, Sequence


class PackingStats:
  """Plain-JSON counters, saved in the iterator state so they survive a restore."""

  def __init__(self, group_names: Sequence[str]):
    self._names = tuple(group_names)
    self.rows = 0
    self.tokens = 0
    self.image_tokens = 0  # decode work of the usable samples drawn (see PreparedSample)
    self.counts = {name: collections.Counter() for name in self._names}  # drawn, packed
    self.drops = {name: collections.Counter() for name in self._names}
    self.notes = {name: collections.Counter() for name in self._names}
    self.missing_mandatory = collections.Counter()

  def drawn(self, group: int, image_tokens: int = 0) -> None:
    self.counts[self._names[group]]["drawn"] += 1
    self.image_tokens += image_tokens

  def dropped(self, group: int, reason: str) -> None:
    # A DropReason counts under its plain value: reports print and dump as plain strings.
    self.drops[self._names[group]][str(reason)] += 1

  def noted(self, group: int, notes: Sequence[str]) -> None:
    for note in notes:
      self.notes[self._names[group]][note] += 1

  def row(self, members, tokens: int, missing: Sequence[int]) -> None:
    self.rows += 1
    self.tokens += tokens
    for s in members:
      self.counts[self._names[s.key.group]]["packed"] += 1
    for g in missing:
      self.missing_mandatory[self._names[g]] += 1

  def to_json(self) -> dict[str, Any]:
    return {
        "rows": self.rows,
        "tokens": self.tokens,
        "image_tokens": self.image_tokens,
        "counts": {k: dict(v) for k, v in self.counts.items()},
        "drops": {k: dict(v) for k, v in self.drops.items()},
        "notes": {k: dict(v) for k, v in self.notes.items()},
        "missing_mandatory": dict(self.missing_mandatory),
    }

  @classmethod
  def from_json(cls, group_names: Sequence[str], state: dict[str, Any]) -> PackingStats:
    stats = cls(group_names)
    stats.rows, stats.tokens = int(state["rows"]), int(state["tokens"])
    stats.image_tokens = int(state["image_tokens"])
    for field in ("counts", "drops", "notes"):
      for name, counter in state[field].items():
        getattr(stats, field)[name].update({k: int(v) for k, v in counter.items()})
    stats.missing_mandatory.update({k: int(v) for k, v in state["missing_mandatory"].items()})
    return stats

  def report(self) -> dict[str, Any]:
    """Counters plus totals: drawn, packed and dropped over all groups."""
    out = self.to_json()
    out["drawn"] = sum(c["drawn"] for c in self.counts.values())
    out["packed"] = sum(c["packed"] for c in self.counts.values())
    out["dropped"] = sum(sum(d.values()) for d in self.drops.values())
    by_reason = collections.Counter()
    for d in self.drops.values():
      by_reason.update(d)
    out["drops_by_reason"] = dict(by_reason)
    return out
