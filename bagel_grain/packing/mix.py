"""Weighted mixing: which group each draw takes, and each group's next usable sample.

Each group's MapDataset is read in index order through a fetcher (in-process, or
worker processes computing ahead). A weighted draw picks among the groups not
yet exhausted with an RNG keyed by (seed, process, draw number), so no draw
depends on how many came before it in any other way. Elements the drop policy
refuses are counted and replaced by the group's next one.

State: each group's next element index and the draw counter, plus the counters
of what was drawn and dropped. A `MixPosition` holds all of it (and the drop
windows) by value: the stage above saves one before a step and puts it back when
the step does not complete. The elements drawn since the position saved last go
back to the fetcher when that very position is put back (`restore`): the step is
tried again (a storage error, a Ctrl-C), and draws the same elements, which are
then taken, not computed again in this process (the fetcher's workers have handed
them over already).
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import weakref
from typing import Any, Callable, Protocol, Sequence

import grain
import numpy as np

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.drop_policy import BadRecordLimits, DropPolicy
from bagel_grain.workers import Fetcher
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing import draw_key
from bagel_grain.packing.shares import cumulative_shares
from bagel_grain.packing.stage import PositionedStageIterator
from bagel_grain.packing.state import entry, sequence, whole
from bagel_grain.packing.stats import DrawCounts

_DRAW_STREAM = 0xD7A3  # separates group draws from every other use of the seed

# How far past each group's next index the fetcher keeps elements in flight.
MIN_READ_AHEAD = 2  # any group may be drawn next: its next elements are always under way
# Shared among the groups by weight. A worker holds up to 4 jobs (fetcher.JOBS_PER_WORKER);
# twice that per worker keeps every worker busy while the packer takes finished results.
READ_AHEAD_PER_WORKER = 8
MANDATORY_READ_AHEAD = 1  # a mandatory group is also read once per row, whatever its weight


def read_ahead(weights: Sequence[float], mandatory: Sequence[bool], workers: int) -> list[int]:
  """Per group, how many elements past its next one the fetcher computes ahead."""
  total = sum(weights) or 1.0
  return [MIN_READ_AHEAD + int(READ_AHEAD_PER_WORKER * workers * w / total)
          + MANDATORY_READ_AHEAD * int(m) for w, m in zip(weights, mandatory)]


class ElementFetcher(Protocol):
  """Elements of the groups' MapDatasets by (group, index); see `workers.Fetcher`."""

  def get(self, group: int, index: int) -> Any: ...

  def get_many(self, keys: Sequence[tuple[int, int]]) -> list[Any]: ...

  def put_back(self, group: int, index: int, element: Any) -> None: ...

  def reset(self) -> None: ...

  def close(self) -> None: ...


FetcherFactory = Callable[[Sequence[grain.MapDataset]], ElementFetcher]


def inline_fetcher(groups: Sequence[grain.MapDataset]) -> Fetcher:
  """Computes every element in the calling process, when it is asked for."""
  return Fetcher(groups, workers=0, depths=[0] * len(groups))


_WORD = 2**32


def draw_group(seed: int, process_index: int, draw: int, weights: Sequence[float],
               active: Sequence[bool]) -> int:
  """The group of weighted draw number `draw`, from an RNG keyed by (seed, process, draw)."""
  return group_at(draw_uniform(seed, process_index, draw),
                  cumulative_shares(weights, active).tolist())


def draw_uniform(seed: int, process_index: int, draw: int) -> float:
  """Weighted draw number `draw`'s uniform in [0, 1), keyed by (seed, process, draw):
  `np.random.default_rng([seed, stream, process, draw]).random()`, worked out in Python
  when every number is under 2**32 (`draw_key`: a third of numpy's cost per draw)."""
  key = (seed, _DRAW_STREAM, process_index, draw)
  if 0 <= min(key) and max(key) < _WORD:
    return draw_key.uniform(*key)
  return np.random.default_rng(list(key)).random()


def group_at(u: float, cumulative: Sequence[float]) -> int:
  """The group whose share (`cumulative_shares`, as floats) holds `u`: the first bound
  above it, the last group if none is (the same float comparisons as
  `np.searchsorted(..., side="right")`, without an array per draw)."""
  return min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)


@dataclasses.dataclass(frozen=True)
class MixSpec:
  """What the mixing stage decides with; built from the config by the pipeline."""

  group_names: tuple[str, ...]
  weights: tuple[float, ...]
  records_per_epoch: tuple[int, ...]
  seed: int
  process_index: int
  drops: DropPolicy
  # Per group, (first element, first epoch, records per epoch) of each record set after
  # the first (records appended at a restore; sources/records.py).
  later_eras: tuple[tuple[tuple[int, int, int], ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class MixPosition:
  """Where the mixing stage stands: all it changes while drawing, by value."""

  next_index: tuple[int, ...]
  draws: int
  counts: dict[str, Any]  # DrawCounts.to_json()
  windows: tuple[tuple[Any, ...], ...] = ()  # BadRecordLimits.windows(); () when restored


class MixDataset(grain.IterDataset):
  """Usable samples drawn by weight (`next`), or from one group (`MixIterator.next_of`)."""

  def __init__(self, groups: Sequence[grain.MapDataset], spec: MixSpec,
               fetcher: FetcherFactory = inline_fetcher):
    super().__init__(list(groups))
    self.groups = tuple(groups)
    self.spec = spec
    self._fetcher = fetcher

  def __iter__(self) -> MixIterator:
    return self.iterator()

  def iterator(self, fetcher: FetcherFactory | None = None) -> MixIterator:
    """An iterator reading the groups through `fetcher` (default: the dataset's)."""
    return MixIterator(self.groups, self.spec, self._fetcher if fetcher is None else fetcher)

  def __str__(self) -> str:
    return f"MixDataset(groups={self.spec.group_names})"


class MixIterator(PositionedStageIterator):
  """Each group's next usable sample, and weighted draws among the groups."""

  def __init__(self, groups: Sequence[grain.MapDataset], spec: MixSpec,
               fetcher: FetcherFactory = inline_fetcher):
    super().__init__()
    self._groups = list(groups)
    self._lengths = [len(g) for g in self._groups]  # asked once: each is a chain of calls
    self._spec = spec
    self._close_fetcher: Callable[[], Any] = lambda: None  # until there is a fetcher
    self._fetcher = fetcher(self._groups)
    # Closes the fetcher at close(), or at interpreter exit while the modules still work.
    self._close_fetcher = weakref.finalize(self, self._fetcher.close)
    self._limits = BadRecordLimits(spec.drops, spec.group_names)
    self._next_index = [0] * len(self._groups)
    self._draws = 0
    self._counts = DrawCounts(spec.group_names)
    # The elements drawn since `position()` last returned `_drawn_since` (see `restore`).
    self._drawn: list[tuple[int, int, Any]] = []
    self._drawn_since: MixPosition | None = None
    self._shares: dict[tuple[bool, ...], list[float]] = {}  # cumulative shares by active groups

  @property
  def group_names(self) -> tuple[str, ...]:
    return self._spec.group_names

  @property
  def fetcher(self) -> ElementFetcher:
    """What the groups are read through (the batching stage has its workers copy pixels)."""
    return self._fetcher

  def exhausted(self, group: int) -> bool:
    return self._next_index[group] >= self._lengths[group]

  def __next__(self) -> PreparedSample:
    """A usable sample from a group drawn by weight among those not yet exhausted."""
    return self._stats.record_output_spec(self._own_time(self._weighted))

  def next_of(self, group: int) -> PreparedSample | None:
    """The group's next usable sample (drops counted); None once it is exhausted."""
    return self._own_time(self._usable, group)

  def _weighted(self) -> PreparedSample:
    spec = self._spec
    while True:
      active = tuple(not self.exhausted(g) and w > 0 for g, w in enumerate(spec.weights))
      if not any(active):
        raise StopIteration
      cumulative = self._shares.get(active)
      if cumulative is None:
        cumulative = self._shares[active] = cumulative_shares(spec.weights, active).tolist()
      group = group_at(draw_uniform(spec.seed, spec.process_index, self._draws), cumulative)
      self._draws += 1
      sample = self._usable(group)
      if sample is not None:
        return sample

  def _usable(self, group: int) -> PreparedSample | None:
    bad = None  # drops since the last usable sample, by reason (rare: made at the first)
    while not self.exhausted(group):
      index = self._next_index[group]
      self._next_index[group] += 1
      element = self._waiting(self._fetcher.get, group, index)
      self._drawn.append((group, index, element))
      reason = self._spec.drops.reason(element)
      self._limits.check_window(group, reason, element.key.record)
      if reason is None:
        self._counts.drawn(group, element.image_tokens)
        self._counts.noted(group, element.notes)
        return element
      self._counts.drawn(group)
      self._counts.dropped(group, reason)
      bad = bad if bad is not None else collections.Counter()
      bad[reason] += 1
      self._limits.check_consecutive(group, bad, element.key.record)
    return None

  def recreate(self, keys: Sequence[Sequence[int]]) -> list[PreparedSample]:
    """Samples drawn before a restore, re-created from their (group, index) keys."""
    samples = self._fetcher.get_many([(int(g), int(i)) for g, i in keys])
    for (g, i), s in zip(keys, samples):
      if not isinstance(s, PreparedSample):
        raise StateMismatchError(f"group {self._spec.group_names[g]!r} element {i} was a "
                                 "packable sample when the state was saved and is not now: "
                                 "the data changed under the checkpoint")
    return samples

  def epochs(self, position: MixPosition | None = None) -> dict[str, int]:
    """Per group, the epoch of the last element drawn (at `position`, default now)."""
    next_index = self._next_index if position is None else position.next_index
    return {name: self._epoch_of(g, max(0, next_index[g] - 1))
            for g, name in enumerate(self._spec.group_names)}

  def _epoch_of(self, group: int, index: int) -> int:
    eras = self._spec.later_eras[group] if self._spec.later_eras else ()
    for first, epoch, n in reversed(eras):
      if index >= first:
        return epoch + (index - first) // n
    return index // self._spec.records_per_epoch[group]

  def position(self) -> MixPosition:
    position = MixPosition(tuple(self._next_index), self._draws, self._counts.to_json(),
                           self._limits.windows())
    self._drawn, self._drawn_since = [], position
    return position

  def forget_drawn(self) -> None:
    """Lets go of the elements drawn since the last `position()` (a step completed)."""
    self._drawn, self._drawn_since = [], None

  def restore(self, position: MixPosition) -> None:
    """Back to `position` (one saved by `position()`, or parsed from a state). When it is
    the position `position()` returned last, the elements drawn since go back to the
    fetcher: the draws from it ask for the same ones (by group and index) next."""
    if position is self._drawn_since:
      for group, index, element in self._drawn:
        self._fetcher.put_back(group, index, element)
    self.forget_drawn()
    self._limits = BadRecordLimits(self._spec.drops, self._spec.group_names, position.windows)
    self._next_index = list(position.next_index)
    self._draws = position.draws
    self._counts = DrawCounts.from_json(self._spec.group_names, position.counts)

  def parse_state(self, state: dict[str, Any]) -> MixPosition:
    """This stage's keys of a state, checked; StateMismatchError naming a malformed field."""
    n = len(self._groups)
    next_index = tuple(whole(i, f"next_index[{g}]", greatest=len(self._groups[g]))
                       for g, i in enumerate(sequence(entry(state, "next_index"), "next_index",
                                                      length=n)))
    draws = whole(entry(state, "draws"), "draws")
    counts = DrawCounts.from_json(self._spec.group_names, entry(state, "stats")).to_json()
    return MixPosition(next_index, draws, counts)

  def state_of(self, position: MixPosition) -> dict[str, Any]:
    return {"next_index": list(position.next_index), "draws": position.draws,
            "stats": copy.deepcopy(position.counts)}

  def forget_prefetched(self) -> None:
    """Lets go of the elements computed ahead (before continuing from another position)."""
    self._fetcher.reset()

  def close(self) -> None:
    self._close_fetcher()
    super().close()

  def __str__(self) -> str:
    return f"MixIterator(groups={self._spec.group_names})"
