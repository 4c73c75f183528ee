"""The stages' counters: what mixing drew and dropped, what packing put into rows.

Plain JSON, saved in the iterator state so they survive a restore. Each stage
counts its own; the state keeps them in one `stats` dict, where `counts` holds
per group `drawn` (mixing) and `packed` (packing). The layout is fixed for a
given set of groups: every group, every `DropReason` and every `Note` is present,
zero when unused, so the state's structure never changes from step to step (as
Grain's checkpoint contract asks). A group's drops are a list of counts in the
order `drop_reasons` names once (the reasons' names would triple the state). States of versions 1 and 2 listed only what
was non-zero: an absent entry reads as zero, an unknown one is refused.
`report` gives the non-zero counters, as reports always did.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from bagel_grain.drops import DropReason, Note
from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.state import counter, entry, mapping, per_group, sequence, whole

REASONS = tuple(r.value for r in DropReason)
NOTES = tuple(n.value for n in Note)


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

  def dropped(self, group: int, reason: DropReason) -> None:
    # A DropReason counts under its plain value: reports print and dump as plain strings.
    self.drops[self._names[group]][DropReason(reason).value] += 1

  def noted(self, group: int, notes: Sequence[str]) -> None:
    for note in notes:
      self.notes[self._names[group]][Note(note).value] += 1

  def to_json(self) -> dict[str, Any]:
    return {"image_tokens": self.image_tokens,
            "counts": {name: {"drawn": self.drawn_by.get(name, 0)} for name in self._names},
            "drop_reasons": list(REASONS),  # names the entries of each group's `drops`
            # (`get`: a Counter's missing key is a Python call, and this runs at every step)
            "drops": {k: [v.get(r, 0) for r in REASONS] for k, v in self.drops.items()},
            "notes": {k: {n: v.get(n, 0) for n in NOTES} for k, v in self.notes.items()}}

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
    reasons = stats.get("drop_reasons")
    if reasons is not None:
      reasons = _known(dict.fromkeys(sequence(reasons, "stats.drop_reasons"), 0),
                       "stats.drop_reasons", REASONS)
    for field, known in (("drops", REASONS), ("notes", NOTES)):
      groups = per_group(entry(stats, field, f"stats.{field}"), f"stats.{field}", out._names)
      for name, counts in groups.items():
        where = f"stats.{field}.{name}"
        if field == "drops" and reasons is not None:  # counts listed in `drop_reasons` order
          counts = dict(zip(reasons, sequence(counts, where, length=len(reasons))))
        getattr(out, field)[name].update(_known(counts, where, known))
    return out


def _known(value: Any, field: str, known: Sequence[str]) -> dict[str, int]:
  """A counter whose keys are all in `known` (unknown ones are named, a few of them)."""
  counts = counter(value, field)
  unknown = sorted(set(counts) - set(known))
  if unknown:
    shown = ", ".join(repr(k[:40]) for k in unknown[:5])
    raise StateMismatchError(f"state field `{field}`: {len(unknown)} unknown names ({shown}"
                             f"{', ...' if len(unknown) > 5 else ''}); they must be among "
                             f"{', '.join(known)}")
  return counts


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
            "counts": {name: {"packed": self.packed_by.get(name, 0)} for name in self._names},
            "missing_mandatory": {name: self.missing_mandatory.get(name, 0)
                                  for name in self._names}}

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
    out.missing_mandatory.update(_known(
        entry(stats, "missing_mandatory", "stats.missing_mandatory"), "stats.missing_mandatory",
        out._names))
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
          "counts": counts, "drop_reasons": draws["drop_reasons"], "drops": draws["drops"],
          "notes": draws["notes"],
          "missing_mandatory": rows["missing_mandatory"]}


def report(stats: dict[str, Any]) -> dict[str, Any]:
  """The non-zero counters plus totals: drawn, packed and dropped over all groups, drops by
  reason."""
  stats = {**stats, "drops": {name: dict(zip(stats["drop_reasons"], counts))
                               for name, counts in stats["drops"].items()}}
  del stats["drop_reasons"]
  out = _nonzero(stats)
  out["drawn"] = sum(c.get("drawn", 0) for c in out["counts"].values())
  out["packed"] = sum(c.get("packed", 0) for c in out["counts"].values())
  out["dropped"] = sum(sum(d.values()) for d in out["drops"].values())
  by_reason = collections.Counter()
  for d in out["drops"].values():
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


def _nonzero(tree: Any) -> Any:
  """Nested counters without their zero entries (a group's mapping stays, maybe empty)."""
  if not isinstance(tree, dict):
    return tree
  return {k: _nonzero(v) for k, v in tree.items() if isinstance(v, dict) or v}
