"""The stages' counters: what mixing drew and dropped, what packing put into rows.

Plain JSON, saved in the iterator state so they survive a restore. Each stage
counts its own; the state keeps them in one `stats` dict (the layout of state
version 1), where `counts` holds per group `drawn` (mixing) and `packed` (packing).
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.state import counter, entry, mapping, per_group, whole


class DrawCounts:
  """The mixing stage's counters: records drawn and dropped per group, notes, decode work."""

  def __init__(self, group_names: Sequence[str]):
    self._names = tuple(group_names)
    self.image_tokens = 0  # decode work of the usable samples drawn (see PreparedSample)
    self.drawn_by = collections.Counter()
    self.drops = {name: collections.Counter() for name in self._names}
    self.notes = {name: collections.Counter() for name in self._names}

  def drawn(self, group: int, image_tokens: int = 0) -> None:
    self.drawn_by[self._names[group]] += 1
    self.image_tokens += image_tokens

  def dropped(self, group: int, reason: str) -> None:
    # A DropReason counts under its plain value: reports print and dump as plain strings.
    self.drops[self._names[group]][str(reason)] += 1

  def noted(self, group: int, notes: Sequence[str]) -> None:
    for note in notes:
      self.notes[self._names[group]][note] += 1

  def to_json(self) -> dict[str, Any]:
    return {"image_tokens": self.image_tokens,
            "counts": {name: {"drawn": self.drawn_by[name]} if self.drawn_by[name] else {}
                       for name in self._names},
            "drops": {k: dict(v) for k, v in self.drops.items()},
            "notes": {k: dict(v) for k, v in self.notes.items()}}

  @classmethod
  def from_json(cls, group_names: Sequence[str], stats: Any) -> DrawCounts:
    """Its counters out of a state's `stats` (the other stage's keys are left alone);
    StateMismatchError naming the field when they are malformed."""
    out = cls(group_names)
    stats = mapping(stats, "stats")
    out.image_tokens = whole(entry(stats, "image_tokens", "stats.image_tokens"),
                             "stats.image_tokens")
    for name, n in _group_counts(stats, out._names, "drawn").items():
      out.drawn_by[name] = n
    for field in ("drops", "notes"):
      groups = per_group(entry(stats, field, f"stats.{field}"), f"stats.{field}", out._names)
      for name, counts in groups.items():
        getattr(out, field)[name].update(counter(counts, f"stats.{field}.{name}"))
    return out


class RowCounts:
  """The packing stage's counters: rows, tokens, samples packed, mandatory groups missed."""

  def __init__(self, group_names: Sequence[str]):
    self._names = tuple(group_names)
    self.rows = 0
    self.tokens = 0
    self.packed_by = collections.Counter()
    self.missing_mandatory = collections.Counter()

  def row(self, groups: Sequence[int], tokens: int, missing: Sequence[int]) -> None:
    """A row of samples from `groups` (one entry per sample), lacking the groups `missing`."""
    self.rows += 1
    self.tokens += tokens
    for g in groups:
      self.packed_by[self._names[g]] += 1
    for g in missing:
      self.missing_mandatory[self._names[g]] += 1

  def to_json(self) -> dict[str, Any]:
    return {"rows": self.rows, "tokens": self.tokens,
            "counts": {name: {"packed": self.packed_by[name]} if self.packed_by[name] else {}
                       for name in self._names},
            "missing_mandatory": dict(self.missing_mandatory)}

  @classmethod
  def from_json(cls, group_names: Sequence[str], stats: Any) -> RowCounts:
    """Its counters out of a state's `stats` (the other stage's keys are left alone);
    StateMismatchError naming the field when they are malformed."""
    out = cls(group_names)
    stats = mapping(stats, "stats")
    out.rows = whole(entry(stats, "rows", "stats.rows"), "stats.rows")
    out.tokens = whole(entry(stats, "tokens", "stats.tokens"), "stats.tokens")
    for name, n in _group_counts(stats, out._names, "packed").items():
      out.packed_by[name] = n
    missing = counter(entry(stats, "missing_mandatory", "stats.missing_mandatory"),
                      "stats.missing_mandatory")
    unknown = set(missing) - set(out._names)
    if unknown:
      raise StateMismatchError(f"state field `stats.missing_mandatory`: unknown groups "
                               f"{sorted(unknown)}")
    out.missing_mandatory.update(missing)
    return out


def _group_counts(stats: Any, names: Sequence[str], key: str) -> dict[str, int]:
  """Per group, the count `key` of `stats.counts` (absent: none)."""
  counts = per_group(entry(stats, "counts", "stats.counts"), "stats.counts", names)
  out = {}
  for name in names:
    entries = mapping(counts[name], f"stats.counts.{name}")
    if key in entries:
      out[name] = whole(entries[key], f"stats.counts.{name}.{key}")
  return out


def merged(draws: dict[str, Any], rows: dict[str, Any]) -> dict[str, Any]:
  """The state's `stats`: both stages' counters, `counts` joined per group."""
  counts = {name: {**draws["counts"][name], **rows["counts"][name]} for name in draws["counts"]}
  return {"rows": rows["rows"], "tokens": rows["tokens"], "image_tokens": draws["image_tokens"],
          "counts": counts, "drops": draws["drops"], "notes": draws["notes"],
          "missing_mandatory": rows["missing_mandatory"]}


def report(stats: dict[str, Any]) -> dict[str, Any]:
  """The counters plus totals: drawn, packed and dropped over all groups, drops by reason."""
  out = dict(stats)
  out["drawn"] = sum(c.get("drawn", 0) for c in stats["counts"].values())
  out["packed"] = sum(c.get("packed", 0) for c in stats["counts"].values())
  out["dropped"] = sum(sum(d.values()) for d in stats["drops"].values())
  by_reason = collections.Counter()
  for d in stats["drops"].values():
    by_reason.update(d)
  out["drops_by_reason"] = dict(by_reason)
  return out


def summed(reports: Sequence[Any]) -> Any:
  """Reports (or any nested dicts of numbers) added up key by key, a missing key as 0:
  the counters of the logical shards one process serves."""
  if not isinstance(reports[0], dict):
    return sum(reports)
  keys = dict.fromkeys(k for r in reports for k in r)
  return {k: summed([r[k] for r in reports if k in r]) for k in keys}
