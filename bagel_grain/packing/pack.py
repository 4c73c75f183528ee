"""Greedy row packing: BAGEL's buffer rules over the mixing stage's samples.

Per row (docs/design.md, section 5): carried samples first, then one sample of each
mandatory group, then buffered samples while the row is short of
`prefer_buffer_before`, else weighted draws, until the row holds
`expected_num_tokens`. Unlike upstream, no sample is ever lost (a sample that
cannot be buffered is carried to the next row) and a row never exceeds a
capacity. Each element is one row: its samples, in order.

State: the keys of the buffered and carried samples (re-created by random
access on restore) in lists of fixed length, plus the row counters; the mixing
stage's state beside it.
A `PackPosition` holds all of it by value (the samples themselves, not keys), so
the stage above can put a step that did not complete back.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import grain

from bagel_grain.packing import stats
from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.mix import FetcherFactory, MixDataset, MixIterator, MixPosition
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.row import Capacities, Usage
from bagel_grain.packing.stage import PositionedStageIterator
from bagel_grain.packing.state import entry, sequence, whole
from bagel_grain.packing.stats import RowCounts


EMPTY = [-1, -1]  # an unused slot of the state's `buffer` and `carried` lists


def _slots(samples: Sequence[PreparedSample], slots: int) -> list[list[int]]:
  """The samples' (group, index) keys in a list of fixed length: the state's structure does
  not change with how many samples wait (Grain's checkpoint contract)."""
  if len(samples) > slots:
    raise AssertionError(f"{len(samples)} samples waiting, over the {slots} the rules allow")
  return [[s.key.group, s.key.index] for s in samples] + [list(EMPTY)] * (slots - len(samples))


@dataclasses.dataclass(frozen=True)
class PackSpec:
  """What the packing stage decides with; built from the config by the pipeline."""

  mandatory: tuple[bool, ...]
  expected_num_tokens: int
  max_num_tokens: int
  prefer_buffer_before: int
  max_buffer_size: int
  capacities: Capacities


@dataclasses.dataclass(frozen=True)
class PackPosition:
  """Where the packing stage (and the mixing stage under it) stands, by value."""

  mix: MixPosition
  buffer: tuple[PreparedSample, ...]
  carried: tuple[PreparedSample, ...]
  counts: dict[str, Any]  # RowCounts.to_json()


class PackDataset(grain.IterDataset):
  """Rows of samples (tuples of `PreparedSample`) packed from a `MixDataset`."""

  def __init__(self, mixed: MixDataset, spec: PackSpec):
    super().__init__(mixed)
    self.mixed = mixed
    self.spec = spec

  def __iter__(self) -> PackIterator:
    return self.iterator()

  def iterator(self, fetcher: FetcherFactory | None = None) -> PackIterator:
    """An iterator whose mixing stage reads through `fetcher` (default: its own)."""
    return PackIterator(self.mixed.iterator(fetcher), self.spec)

  def __str__(self) -> str:
    return "PackDataset"


class PackIterator(PositionedStageIterator):
  """The buffer, the carried samples and the row being filled; see the module docstring."""

  def __init__(self, mix: MixIterator, spec: PackSpec):
    super().__init__(mix)
    self._mix = mix
    self._spec = spec
    self._used = Usage()  # what the row being filled occupies
    self._buffer: collections.deque[PreparedSample] = collections.deque()
    self._carried: collections.deque[PreparedSample] = collections.deque()
    self._counts = RowCounts(mix.group_names)

  @property
  def group_names(self) -> tuple[str, ...]:
    return self._mix.group_names

  @property
  def fetcher(self):
    """The mixing stage's fetcher."""
    return self._mix.fetcher

  def __next__(self) -> tuple[PreparedSample, ...]:
    return self._stats.record_output_spec(self._own_time(self._next_row))

  def _next_row(self) -> tuple[PreparedSample, ...]:
    self._used = Usage()
    members: list[PreparedSample] = []
    self._take_carried(members)
    self._take_mandatory(members)
    self._fill(members)
    if not members:
      raise StopIteration
    groups = [s.key.group for s in members]
    self._counts.row(groups, self._used.tokens, missing=[
        g for g, m in enumerate(self._spec.mandatory)
        if m and not self._mix.exhausted(g) and g not in groups])
    return tuple(members)

  def _fits(self, s: PreparedSample) -> bool:
    return (self._used.tokens + s.packed_size <= self._spec.max_num_tokens
            and not self._spec.capacities.overflows(self._used + s.usage))

  def _add(self, s: PreparedSample, members: list[PreparedSample]) -> None:
    """Puts `s` in the row (only once `_fits` said it does)."""
    self._used = self._used + s.usage
    members.append(s)

  def _take_carried(self, members: list[PreparedSample]) -> None:
    """Carried samples that fit open the row; the others wait for the next."""
    waiting = collections.deque()
    for s in self._carried:
      if self._fits(s):
        self._add(s, members)
      else:
        waiting.append(s)
    self._carried = waiting

  def _take_mandatory(self, members: list[PreparedSample]) -> None:
    """One sample of each mandatory group not in the row or carried; carried if it does
    not fit."""
    for group, mandatory in enumerate(self._spec.mandatory):
      present = {s.key.group for s in members} | {s.key.group for s in self._carried}
      if not mandatory or group in present:
        continue
      s = self._waiting(self._mix.next_of, group)
      if s is None:
        continue
      if self._fits(s):
        self._add(s, members)
      else:
        self._carried.append(s)

  def _fill(self, members: list[PreparedSample]) -> None:
    """Buffered and drawn samples until the row holds `expected_num_tokens`."""
    spec = self._spec
    while self._used.tokens < spec.expected_num_tokens:
      from_buffer = bool(self._buffer) and self._used.tokens < spec.prefer_buffer_before
      s = self._buffer.popleft() if from_buffer else self._waiting(next, self._mix, None)
      if s is None:  # every group exhausted (finite epochs): drain the buffer
        if not self._buffer:
          return
        s, from_buffer = self._buffer.popleft(), True
      if self._fits(s):
        self._add(s, members)
      elif not from_buffer and len(self._buffer) < spec.max_buffer_size:
        self._buffer.append(s)
      else:
        self._carried.append(s)  # upstream drops it here; we start the next row with it
        return

  def position(self) -> PackPosition:
    return PackPosition(self._mix.position(), tuple(self._buffer), tuple(self._carried),
                        self._counts.to_json())

  def forget_drawn(self) -> None:
    self._mix.forget_drawn()

  def restore(self, position: PackPosition) -> None:
    """Back to `position` (one saved by `position()`, or made by `parse_state`)."""
    self._mix.restore(position.mix)
    self._buffer = collections.deque(position.buffer)
    self._carried = collections.deque(position.carried)
    self._counts = RowCounts.from_json(self.group_names, position.counts)

  def parse_state(self, state: Any) -> PackPosition:
    """A state's position, checked field by field and its samples re-created; nothing
    changes here, so a malformed state (StateMismatchError naming the field) leaves the
    iterator where it was."""
    mixed = self._mix.parse_state(state)
    counts = RowCounts.from_json(self.group_names, entry(state, "stats")).to_json()
    keys = {"buffer": self._keys(state, "buffer", self._spec.max_buffer_size, mixed),
            "carried": self._keys(state, "carried", self._most_carried(), mixed)}
    seen = collections.Counter(key for field in keys.values() for key in field)
    twice = [key for key, n in seen.items() if n > 1]
    if twice:
      raise StateMismatchError(f"state fields `buffer` and `carried` hold the sample "
                               f"{list(twice[0])} {seen[twice[0]]} times")
    samples = self._mix.recreate(keys["buffer"] + keys["carried"])
    buffered = len(keys["buffer"])
    return PackPosition(mixed, tuple(samples[:buffered]), tuple(samples[buffered:]), counts)

  def _most_carried(self) -> int:
    """More than the rules can carry: one per mandatory group and one from the fill, per row,
    for as many rows as the buffer holds samples."""
    return self._spec.max_buffer_size + len(self.group_names) + 1

  def _keys(self, state: Any, field: str, most: int,
            mixed: MixPosition) -> list[tuple[int, int]]:
    """(group, index) of each sample a state's `field` lists: drawn before it was saved.

    The list has `most` slots, the samples first, then `EMPTY` (states of versions 1
    and 2 list only the samples)."""
    keys = []
    slots = sequence(entry(state, field), field, most=most)
    used = next((k for k, key in enumerate(slots) if key == EMPTY), len(slots))
    if any(key != EMPTY for key in slots[used:]):
      raise StateMismatchError(f"state field `{field}`: a sample after an empty slot")
    for k, key in enumerate(slots[:used]):
      group, index = sequence(key, f"{field}[{k}]", length=2)
      group = whole(group, f"{field}[{k}][0]", greatest=len(self.group_names) - 1)
      index = whole(index, f"{field}[{k}][1]", greatest=mixed.next_index[group] - 1)
      keys.append((group, index))
    return keys

  def state_of(self, position: PackPosition) -> dict[str, Any]:
    mixed = self._mix.state_of(position.mix)
    return {"next_index": mixed["next_index"], "draws": mixed["draws"],
            "buffer": _slots(position.buffer, self._spec.max_buffer_size),
            "carried": _slots(position.carried, self._most_carried()),
            "stats": stats.merged(mixed["stats"], position.counts)}

  def forget_prefetched(self) -> None:
    self._mix.forget_prefetched()

  def stats(self, position: PackPosition | None = None) -> dict[str, Any]:
    """Counters for reports (at `position`, default now); they add up: drawn = packed +
    dropped + buffered + carried. `waiting_bytes`: the arrays the buffered and carried
    samples hold (pixels included)."""
    position = self.position() if position is None else position
    report = stats.report(self.state_of(position)["stats"])
    report["buffered"] = len(position.buffer)
    report["carried"] = len(position.carried)
    report["waiting_bytes"] = sum(s.layout.nbytes for s in (*position.buffer, *position.carried))
    report["epoch"] = self._mix.epochs(position.mix)
    return report

  def __str__(self) -> str:
    return "PackIterator"
