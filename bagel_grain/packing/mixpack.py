"""BAGEL's weighted mix and greedy buffer packing as a checkpointable Grain IterDataset.

Per row (docs/design.md, section 5): carried samples first, then one sample of each
mandatory group, then buffered samples while the row is short of
`prefer_buffer_before`, else weighted draws. Unlike upstream, no sample is ever
lost (a sample that cannot be buffered is carried to the next row), a row never
exceeds a capacity, and a group that yields nothing usable is an error.

The state holds counters and sample keys only: each group's next element index,
the weighted-draw counter, and the keys of buffered and carried samples, which
are re-created by random access on restore.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import grain
import numpy as np

from bagel_grain.drops import Dropped, DropReason
from bagel_grain.errors import GroupExhaustedError, StateMismatchError
from bagel_grain.packing.fetch import Fetcher
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.row import Capacities, RowBuilder, Usage, empty_row
from bagel_grain.packing.stats import PackingStats

STATE_VERSION = 1
_DRAW_STREAM = 0xD7A3  # separates group draws from every other use of the seed


@dataclasses.dataclass(frozen=True)
class PackingSpec:
  """Everything the packer decides with; built from the config by the pipeline."""

  group_names: tuple[str, ...]
  weights: tuple[float, ...]
  mandatory: tuple[bool, ...]
  records_per_epoch: tuple[int, ...]
  expected_num_tokens: int
  max_num_tokens: int
  max_num_tokens_per_sample: int
  prefer_buffer_before: int
  max_buffer_size: int
  capacities: Capacities
  seed: int
  process_index: int
  max_consecutive_drops: int
  fingerprint: dict[str, Any]
  bad_record_window: int = 200
  max_bad_ratio: float = 0.9
  workers: int = 0


def _top(reasons: collections.Counter) -> str:
  return ", ".join(f"{r}: {n}" for r, n in reasons.most_common(3))


def draw_group(seed: int, process_index: int, draw: int, weights: Sequence[float],
               active: Sequence[bool]) -> int:
  """The group of weighted draw number `draw`, from an RNG keyed by (seed, process, draw)."""
  w = np.where(active, weights, 0.0)
  u = np.random.default_rng([seed, _DRAW_STREAM, process_index, draw]).random()
  cumulative = np.cumsum(w) / w.sum()
  return int(min(np.searchsorted(cumulative, u, side="right"), len(w) - 1))


class MixPackDataset(grain.IterDataset):
  """Packed rows, or batches of `batch_size` rows, as dicts of static-shape numpy arrays.

  Each element also carries `sample_keys` (per row, the keys of its samples) for
  audits; it never goes to the device. Batching here rather than downstream
  writes every row straight into its batch: pixels are copied once.
  """

  def __init__(self, groups: Sequence[grain.MapDataset], spec: PackingSpec,
               batch_size: int | None = None):
    super().__init__(list(groups))
    self._groups = list(groups)
    self.spec = spec
    self.batch_size = batch_size

  def __iter__(self) -> MixPackIterator:
    return MixPackIterator(self._groups, self.spec, self.batch_size)

  def __str__(self) -> str:
    return f"MixPackDataset(groups={self.spec.group_names})"


class MixPackIterator(grain.DatasetIterator):
  """The packer's state machine; see the module docstring for the rules."""

  def __init__(self, groups: Sequence[grain.MapDataset], spec: PackingSpec,
               batch_size: int | None = None):
    super().__init__()
    self._fetcher = None  # set below; close() may run on a half-built iterator
    self._groups = list(groups)
    self._spec = spec
    self._batch_size = batch_size
    total = sum(spec.weights) or 1.0
    depths = [2 + int(8 * spec.workers * w / total) + int(m)
              for w, m in zip(spec.weights, spec.mandatory)]
    self._fetcher = Fetcher(self._groups, workers=spec.workers, depths=depths)
    self._builder = RowBuilder(spec.capacities)
    self._seconds = {"waiting_for_samples": 0.0, "packing": 0.0}  # main-process time
    self._start()

  def _start(self) -> None:
    n = len(self._groups)
    self._next_index = [0] * n
    self._draws = 0
    self._buffer: collections.deque[PreparedSample] = collections.deque()
    self._carried: collections.deque[PreparedSample] = collections.deque()
    self._counters = PackingStats(self._spec.group_names)
    # Drop reasons (None = usable) of each group's latest records, for the bad-ratio check.
    self._recent = [collections.deque(maxlen=self._spec.bad_record_window) for _ in range(n)]

  # -- drawing samples ---------------------------------------------------------

  def _exhausted(self, group: int) -> bool:
    return self._next_index[group] >= len(self._groups[group])

  def _usable(self, group: int) -> PreparedSample | None:
    """The group's next usable sample (drops counted); None once the group is exhausted."""
    spec = self._spec
    bad = collections.Counter()
    while not self._exhausted(group):
      index = self._next_index[group]
      self._next_index[group] += 1
      start = time.perf_counter()
      element = self._fetcher.get(group, index)
      self._seconds["waiting_for_samples"] += time.perf_counter() - start
      reason = self._drop_reason(element)
      self._check_bad_ratio(group, reason, element.key.record)
      if reason is None:
        self._counters.drawn(group, element.image_tokens)
        self._counters.noted(group, element.notes)
        return element
      self._counters.drawn(group)
      self._counters.dropped(group, reason)
      bad[reason] += 1
      if sum(bad.values()) >= spec.max_consecutive_drops:
        raise GroupExhaustedError(
            f"group {spec.group_names[group]!r} yielded no usable sample in "
            f"{spec.max_consecutive_drops} consecutive records (top reasons: "
            f"{_top(bad)}; last record: {element.key.record}). Fix the data, or raise "
            "`max_consecutive_drops`.")
    return None

  def _check_bad_ratio(self, group: int, reason: str | None, record: str) -> None:
    """Stops a group whose latest `bad_record_window` records are mostly bad."""
    recent, spec = self._recent[group], self._spec
    recent.append(reason)
    if len(recent) < recent.maxlen:
      return
    bad = collections.Counter(r for r in recent if r is not None)
    if sum(bad.values()) > spec.max_bad_ratio * len(recent):
      raise GroupExhaustedError(
          f"group {spec.group_names[group]!r}: {sum(bad.values())} of its last {len(recent)} "
          f"records were dropped (top reasons: {_top(bad)}; last record: {record}). Fix the "
          "data, or raise `max_bad_ratio` / `bad_record_window`.")

  def _drop_reason(self, element: PreparedSample | Dropped) -> DropReason | None:
    if isinstance(element, Dropped):
      return element.reason
    if element.packed_size > self._spec.max_num_tokens_per_sample:
      return DropReason.OVER_MAX_TOKENS_PER_SAMPLE
    over = self._spec.capacities.overflows(Usage.of(element.layout))
    return DropReason.over_row_capacity(over[0]) if over else None

  def _weighted(self) -> PreparedSample | None:
    """A sample from a group drawn by weight among the groups not yet exhausted."""
    spec = self._spec
    while True:
      active = [not self._exhausted(g) and w > 0 for g, w in enumerate(spec.weights)]
      if not any(active):
        return None
      group = draw_group(spec.seed, spec.process_index, self._draws, spec.weights, active)
      self._draws += 1
      sample = self._usable(group)
      if sample is not None:
        return sample

  # -- packing -----------------------------------------------------------------

  def __next__(self) -> dict[str, Any]:
    start, waited = time.perf_counter(), self._seconds["waiting_for_samples"]
    try:
      return self._next_element()
    finally:
      elapsed = time.perf_counter() - start
      self._seconds["packing"] += elapsed - (self._seconds["waiting_for_samples"] - waited)

  def _next_element(self) -> dict[str, Any]:
    if self._batch_size is None:
      members = self._next_row()
      row = self._builder.build()
      row["sample_keys"] = self._keys(members)
      return row
    batch = empty_row(self._spec.capacities, (self._batch_size,))
    keys = []
    for b in range(self._batch_size):
      try:
        members = self._next_row()
      except StopIteration:
        if b == 0:
          raise
        break  # a finite stream's last batch: the remaining rows stay empty
      self._builder.build(batch, b)
      keys.append(self._keys(members))
    batch["sample_keys"] = keys + [()] * (self._batch_size - len(keys))
    return batch

  def _keys(self, members: Sequence[PreparedSample]) -> tuple:
    names = self._spec.group_names
    return tuple((names[s.key.group], s.key.index, s.key.epoch, s.key.record) for s in members)

  def _next_row(self) -> list[PreparedSample]:
    """Decides the next row's samples (the builder holds their layouts)."""
    spec, builder = self._spec, self._builder
    builder.reset()
    members: list[PreparedSample] = []

    def fits(s: PreparedSample) -> bool:
      return (builder.used_tokens + s.packed_size <= spec.max_num_tokens
              and builder.fits(s.layout))

    def add(s: PreparedSample) -> None:
      builder.add(s.layout)
      members.append(s)

    waiting = collections.deque()
    for s in self._carried:
      (add if fits(s) else waiting.append)(s)
    self._carried = waiting

    for group, mandatory in enumerate(spec.mandatory):
      present = {s.key.group for s in members} | {s.key.group for s in self._carried}
      if not mandatory or group in present:
        continue
      s = self._usable(group)
      if s is not None:
        (add if fits(s) else self._carried.append)(s)

    while builder.used_tokens < spec.expected_num_tokens:
      from_buffer = bool(self._buffer) and builder.used_tokens < spec.prefer_buffer_before
      s = self._buffer.popleft() if from_buffer else self._weighted()
      if s is None:  # every group exhausted (finite epochs): drain the buffer
        if not self._buffer:
          break
        s, from_buffer = self._buffer.popleft(), True
      if fits(s):
        add(s)
      elif not from_buffer and len(self._buffer) < spec.max_buffer_size:
        self._buffer.append(s)
      else:
        self._carried.append(s)  # upstream drops it here; we start the next row with it
        break

    if not members:
      raise StopIteration
    self._counters.row(members, builder.used_tokens, missing=[
        g for g, m in enumerate(spec.mandatory)
        if m and not self._exhausted(g) and g not in {s.key.group for s in members}])
    return members

  # -- state -------------------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "fingerprint": dict(self._spec.fingerprint),
        "next_index": list(self._next_index),
        "draws": self._draws,
        "buffer": [[s.key.group, s.key.index] for s in self._buffer],
        "carried": [[s.key.group, s.key.index] for s in self._carried],
        "stats": self._counters.to_json(),
    }

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
      raise StateMismatchError(f"iterator state version {state.get('version')!r}; this "
                               f"bagel_grain reads version {STATE_VERSION}")
    saved, ours = state.get("fingerprint", {}), self._spec.fingerprint
    changed = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
    if changed:
      detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {ours.get(k)!r}" for k in changed)
      raise StateMismatchError(
          f"the saved state belongs to a different stream ({detail}). Restore with the "
          "same config, tokenizer, seed and process layout, or start without the state.")
    self._fetcher.reset()
    self._start()
    self._next_index = [int(i) for i in state["next_index"]]
    self._draws = int(state["draws"])
    self._counters = PackingStats.from_json(self._spec.group_names, state["stats"])
    self._buffer = collections.deque(self._recreate(state["buffer"]))
    self._carried = collections.deque(self._recreate(state["carried"]))

  def _recreate(self, keys: Sequence[Sequence[int]]) -> list[PreparedSample]:
    """Buffered or carried samples, re-created from their keys by random access."""
    samples = self._fetcher.get_many([(int(g), int(i)) for g, i in keys])
    for (g, i), s in zip(keys, samples):
      if not isinstance(s, PreparedSample):
        raise StateMismatchError(f"group {self._spec.group_names[g]!r} element {i} was a "
                                 "packable sample when the state was saved and is not now: "
                                 "the data changed under the checkpoint")
    return samples

  def stats(self) -> dict[str, Any]:
    """Counters for reports; they add up: drawn = packed + dropped + buffered + carried."""
    report = self._counters.report()
    report["seconds"] = dict(self._seconds)
    report["buffered"] = len(self._buffer)
    report["carried"] = len(self._carried)
    report["epoch"] = {
        name: max(0, self._next_index[g] - 1) // n
        for g, (name, n) in enumerate(zip(self._spec.group_names, self._spec.records_per_epoch))}
    return report

  def close(self) -> None:
    if self._fetcher is not None:
      self._fetcher.close()
