"""Interleaving: one process's rows, from the packers of the logical shards it serves.

Process `p` of `P` serves the logical shards `s` with `s % P == p` (docs/elastic.md);
each has its own mixing and packing stages over its own share of the records, and
all of them one fetcher (one pool of workers). The next row comes from the served
shard that has packed the fewest rows so far (the lowest shard number on a tie)
among those not yet ended: the rule needs no state beyond each shard's own, so
after a resize the shards a process inherits catch up with each other first.

State: per served shard, its row count, whether it ended, and its packing stage's
state; the checkpoint splits it into one file per shard (`split_state`) and any
process count re-assembles the files it needs (`joined_states`). An
`InterleavePosition` holds all of it by value, for the batching stage to put a
step back.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import grain

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing import stats
from bagel_grain.packing.mix import ElementFetcher, FetcherFactory
from bagel_grain.packing.pack import PackDataset, PackIterator, PackPosition
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.stage import PositionedStageIterator
from bagel_grain.packing.state import entry, mapping, whole

_SHARD_KEYS = ("shard", "rows", "ended", "packer")  # a shard's part of a saved state
_OPTIONAL_SHARD_KEYS = ("eras",)  # where a group's later record sets start (packing/eras.py)


@dataclasses.dataclass(frozen=True)
class InterleavePosition:
  """Where the interleaving stage stands: per served shard, its packer's position and its
  row count, and which shards ended."""

  packers: tuple[tuple[int, PackPosition], ...]
  rows: tuple[tuple[int, int], ...]
  ended: frozenset[int]


class _GroupsFrom:
  """One shard's view of the shared fetcher: its groups are `offset`, `offset + 1`, ..."""

  def __init__(self, fetcher: ElementFetcher, offset: int):
    self._fetcher, self._offset = fetcher, offset

  def get(self, group: int, index: int) -> Any:
    return self._fetcher.get(self._offset + group, index)

  def get_many(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
    return self._fetcher.get_many([(self._offset + g, i) for g, i in keys])

  def put_back(self, group: int, index: int, element: Any) -> None:
    self._fetcher.put_back(self._offset + group, index, element)

  def reset(self) -> None:
    self._fetcher.reset()

  def close(self) -> None:
    pass  # the interleaving stage closes the shared fetcher


class ShardInterleaveDataset(grain.IterDataset):
  """Rows (tuples of `PreparedSample`) of the served shards, interleaved; its parents
  are the shards' packing stages, keyed by logical shard."""

  def __init__(self, shards: Mapping[int, PackDataset], *, shard_count: int,
               fetcher: FetcherFactory):
    super().__init__(list(shards.values()))
    self._shards = dict(shards)
    self.shard_count = shard_count
    self._fetcher = fetcher

  @property
  def shards(self) -> tuple[int, ...]:
    """The logical shards this process serves."""
    return tuple(self._shards)

  def __iter__(self) -> ShardInterleaveIterator:
    return ShardInterleaveIterator(self._shards, shard_count=self.shard_count,
                                   fetcher=self._fetcher)

  def __str__(self) -> str:
    return f"ShardInterleaveDataset(shards={self.shards} of {self.shard_count})"


class ShardInterleaveIterator(PositionedStageIterator):
  """See the module docstring. Its parents are the served shards' packing iterators,
  whose mixing stages read through views of one fetcher made here."""

  def __init__(self, shards: Mapping[int, PackDataset], *, shard_count: int,
               fetcher: FetcherFactory):
    self._close_fetcher: Callable[[], Any] = lambda: None  # until there is a fetcher
    shared = fetcher([g for shard in shards.values() for g in shard.mixed.groups])
    # Closes the fetcher at close(), or at interpreter exit while the modules still work.
    self._close_fetcher = weakref.finalize(self, shared.close)
    self.fetcher = shared  # the batching stage has its workers copy pixels
    self._packers: dict[int, PackIterator] = {}
    offset = 0
    for s, shard in shards.items():
      view = _GroupsFrom(shared, offset)
      self._packers[s] = shard.iterator(fetcher=lambda _, view=view: view)
      offset += len(shard.mixed.groups)
    super().__init__(list(self._packers.values()))
    self._shard_count = shard_count
    self._rows = dict.fromkeys(self._packers, 0)
    self._ended: set[int] = set()

  @property
  def group_names(self) -> tuple[str, ...]:
    return next(iter(self._packers.values())).group_names

  @property
  def shards(self) -> tuple[int, ...]:
    """The logical shards this process serves."""
    return tuple(self._packers)

  def __next__(self) -> tuple[PreparedSample, ...]:
    return self._stats.record_output_spec(self._own_time(self._next_row))

  def _next_row(self) -> tuple[PreparedSample, ...]:
    while True:
      live = [s for s in self._packers if s not in self._ended]
      if not live:
        raise StopIteration
      shard = min(live, key=lambda s: (self._rows[s], s))
      row = self._waiting(next, self._packers[shard], None)
      if row is None:
        self._ended.add(shard)
        continue
      self._rows[shard] += 1
      return row

  def position(self) -> InterleavePosition:
    return InterleavePosition(tuple((s, it.position()) for s, it in self._packers.items()),
                              tuple(self._rows.items()), frozenset(self._ended))

  def forget_drawn(self) -> None:
    for packer in self._packers.values():
      packer.forget_drawn()

  def restore(self, position: InterleavePosition) -> None:
    """Back to `position` (one saved by `position()`, or made by `parse_state`)."""
    for s, packer in position.packers:
      self._packers[s].restore(packer)
    self._rows = dict(position.rows)
    self._ended = set(position.ended)

  def state_of(self, position: InterleavePosition) -> dict[str, Any]:
    rows = dict(position.rows)
    return {"logical_shards": self._shard_count,
            "shards": {str(s): {"rows": rows[s], "ended": s in position.ended,
                                "packer": self._packers[s].state_of(packer)}
                       for s, packer in position.packers}}

  def forget_prefetched(self) -> None:
    next(iter(self._packers.values())).forget_prefetched()  # the shards share one fetcher

  def parse_state(self, state: Any) -> InterleavePosition:
    """A state's position, checked field by field (and each served shard's samples
    re-created); nothing changes here, so a malformed state (StateMismatchError naming
    the field) leaves the iterator where it was."""
    saved = entry(state, "logical_shards")
    if saved != self._shard_count:
      raise StateMismatchError(
          f"the state was saved with {saved} logical shards and this pipeline has "
          f"{self._shard_count} (logical_shards: saved {saved}, now {self._shard_count}). "
          "Without `logical_shards` there is one per process, so the process count must "
          "stay the same; set `logical_shards` (a new stream) to resume on other counts.")
    shards = mapping(entry(state, "shards"), "shards")
    missing = [s for s in self._packers if str(s) not in shards]
    if missing:
      raise StateMismatchError(
          f"the state holds no entry for logical shards {missing}, which this process serves "
          f"(it holds {sorted(map(str, shards))}; a state saved before logical shards holds "
          "only its own process's)")
    packers, rows, ended = [], [], set()
    for s, packer in self._packers.items():
      field = f"shards.{s}"
      shard = mapping(shards[str(s)], field)
      rows.append((s, whole(entry(shard, "rows", f"{field}.rows"), f"{field}.rows")))
      if not isinstance(entry(shard, "ended", f"{field}.ended"), bool):
        raise StateMismatchError(f"state field `{field}.ended`: expected true or false, got "
                                 f"{shard['ended']!r}")
      if shard["ended"]:
        ended.add(s)
      try:
        packers.append((s, packer.parse_state(entry(shard, "packer", f"{field}.packer"))))
      except StateMismatchError as e:
        raise StateMismatchError(f"logical shard {s}: {e}") from None
    return InterleavePosition(tuple(packers), tuple(rows), frozenset(ended))

  def stats(self, position: InterleavePosition | None = None) -> dict[str, Any]:
    """The packers' counters summed over the served shards (at `position`, default now); a
    group's epoch is the lowest."""
    position = self.position() if position is None else position
    reports = [self._packers[s].stats(packer) for s, packer in position.packers]
    total = stats.summed(reports)
    total["epoch"] = {g: min(r["epoch"][g] for r in reports) for g in reports[0]["epoch"]}
    return total

  def close(self) -> None:
    for packer in self._packers.values():
      packer.close()
    self._close_fetcher()
    super().close()

  def __str__(self) -> str:
    return f"ShardInterleaveIterator(shards={tuple(self._packers)} of {self._shard_count})"


def is_sharded(state: Any) -> bool:
  """Whether `state` is a pipeline state of logical shards (what `split_state` takes)."""
  return isinstance(state, dict) and "shards" in state and "logical_shards" in state


def shard_count(state: dict[str, Any]) -> int:
  """S, the logical shards the state's stream is defined over."""
  return entry(state, "logical_shards")


def served(state: dict[str, Any]) -> list[int]:
  """The logical shards a state (or a process's own state) holds."""
  return [int(s) for s in entry(state, "shards")]


def split_state(state: dict[str, Any]) -> dict[int, dict[str, Any]]:
  """A pipeline state as one self-contained part per logical shard (a checkpoint file):
  the shard's entry beside everything the state holds for all shards."""
  common = {k: v for k, v in state.items() if k != "shards"}
  return {int(s): {**common, "shard": int(s), **entry} for s, entry in state["shards"].items()}


def joined_states(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
  """Parts of `split_state` (from any processes) as one state; they must agree on the rest."""
  common, shards = None, {}
  for part in parts:
    part = mapping(part, "state")
    for key in _SHARD_KEYS:
      entry(part, key)
    rest = {k: v for k, v in part.items() if k not in _SHARD_KEYS + _OPTIONAL_SHARD_KEYS}
    if common is None:
      common, first = rest, part["shard"]
    elif rest.get("save") != common.get("save"):
      raise StateMismatchError(
          f"logical shard {part['shard']} was saved by another save ({rest.get('save')}) than "
          f"logical shard {first} ({common.get('save')}): the checkpoint mixes files of "
          "different saves (a copy gone wrong, a partial sync?)")
    elif rest != common:
      raise StateMismatchError(f"logical shard {part['shard']} was saved by another stream "
                               f"than the other shards ({rest} vs {common})")
    if str(part["shard"]) in shards:
      raise StateMismatchError(f"logical shard {part['shard']} was saved twice")
    shards[str(part["shard"])] = {k: part[k] for k in _SHARD_KEYS + _OPTIONAL_SHARD_KEYS
                                  if k != "shard" and k in part}
  if common is None:
    raise StateMismatchError("no logical shard states to restore from")
  return {**common, "shards": shards}


def merge_states(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
  """The states of several processes as one holding all their shards: what a checkpoint
  holds; any process restores from it the shards it serves."""
  return joined_states(part for state in states for part in split_state(state).values())
