"""Record sets of a group over time: the eras a restore across appended records opens.

When records were appended to a group's data (lines to a JSONL, files to a parquet
folder, a dataset to the group) and a state restores with `allow_changes`, each
logical shard finishes the epoch it is in over the records it started with, and
the grown set joins from its next epoch (`continuation`, docs/changes.md).

A state of such a stream holds, besides the envelope's fingerprint (the data now):

- `data_eras`: per group, the manifest summaries of each earlier record set,
  oldest first (some 80 bytes a dataset and set);
- in each shard's entry, `eras`: per group, the first epoch of each later set in
  that shard (null, between `continuation` and the pipeline, for the set that
  starts at this restore: at the first epoch the shard has not begun).

The files of the earlier sets are not in the state: a checkpoint keeps them
(`data/data_eras.json`, and `data/data_manifest.json` for the set the last save
read), and `plan` finds them by their summaries.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing.state import mapping, sequence, whole
from bagel_grain.sources.manifest import Manifest
from bagel_grain.sources.records import EraStart

DATA_ERAS, ERAS = "data_eras", "eras"  # the state's keys: common, and per shard

Sets = Mapping[str, Sequence[Mapping[str, Manifest]]]  # per group, each earlier set's manifests


@dataclasses.dataclass(frozen=True)
class GroupEras:
  """A group's earlier record sets (per dataset its manifest, oldest first) and, per
  logical shard, where each later set starts."""

  sets: tuple[Mapping[str, Manifest], ...]
  starts: Mapping[int, tuple[EraStart, ...]]


Plan = Mapping[str, GroupEras]  # by group name; a group of one record set is not in it


def plan(stages: Mapping[str, Any], group_names: Sequence[str], *, known: Sets,
         next_index: Mapping[int, Sequence[int]]) -> dict[str, GroupEras]:
  """The eras of a state's stages (after `continuation`), for the shards this process
  serves (`next_index`: per served shard, each group's next element in the state).

  Each earlier set's files come from `known` (what a checkpoint kept, or this iterator
  read), matched by summary; a set whose files are nowhere is a StateMismatchError.
  """
  sets = mapping(stages.get(DATA_ERAS, {}), DATA_ERAS)
  shards = mapping(stages.get("shards", {}), "shards")
  out = {}
  for name, summaries in sets.items():
    if name not in group_names:
      raise StateMismatchError(f"state field `{DATA_ERAS}`: no group {name!r}")
    summaries = sequence(summaries, f"{DATA_ERAS}.{name}")
    found = tuple(_manifests(name, k, mapping(s, f"{DATA_ERAS}.{name}[{k}]"), known)
                  for k, s in enumerate(summaries))
    starts = {}
    for shard, indices in next_index.items():
      field = f"shards.{shard}.{ERAS}"
      entry = mapping(mapping(shards.get(str(shard), {}), f"shards.{shard}").get(ERAS, {}),
                      field)
      firsts = sequence(entry.get(name), f"{field}.{name}", length=len(found))
      group = group_names.index(name)
      if any(first is None for first in firsts) and len(indices) <= group:
        raise StateMismatchError(f"state field `shards.{shard}.packer.next_index`: no entry "
                                 f"for group {name!r}")
      starts[shard] = tuple(
          EraStart(after=whole(indices[group], f"shards.{shard}.packer.next_index[{group}]"))
          if first is None else EraStart(epoch=whole(first, f"{field}.{name}[{k}]"))
          for k, first in enumerate(firsts))
    if found:
      out[name] = GroupEras(found, starts)
  return out


def _manifests(group: str, k: int, summaries: Mapping[str, Any],
               known: Sets) -> Mapping[str, Manifest]:
  """The manifests of a group's k-th earlier set: those in `known` with its summaries."""
  for candidate in known.get(group, ()):
    if {d: m.summary() for d, m in candidate.items()} == dict(summaries):
      return candidate
  raise StateMismatchError(
      f"records were appended to group {group!r} at a restore, and the state goes on over "
      f"the records it had before (set {k}: datasets {sorted(summaries)}); their file lists "
      "are not at hand. Restore through bagel_grain.jax.restore (a checkpoint keeps them), "
      "or pass `saved_manifests` (and `saved_eras`) to set_state")


def state_keys(eras: Plan, resolved: Mapping[int, Mapping[str, Sequence[int]]]
               ) -> tuple[dict[str, Any], dict[int, dict[str, list[int]]]]:
  """(the state's `data_eras`, per served shard its `eras`) of a stream built on `eras`,
  whose later sets start, per shard, at the epochs `resolved`."""
  common = {name: [{d: m.summary() for d, m in s.items()} for s in e.sets]
            for name, e in eras.items()}
  per_shard = {shard: {name: list(firsts) for name, firsts in by_group.items() if name in eras}
               for shard, by_group in resolved.items()}
  return common, per_shard


def known_sets(eras: Plan) -> dict[str, list[Mapping[str, Manifest]]]:
  """Per group, the manifests of its earlier sets (what a checkpoint keeps)."""
  return {name: list(e.sets) for name, e in eras.items()}
