"""Restoring onto a changed stream: what may change, and how a saved state follows.

By default a state restores only onto the stream it was saved from, and every
difference is refused by name. Asked to (`allow_changes=True` on `set_state` or
`bagel_grain.jax.restore`), a run moves on to the next stage of its training:

- a group's weight changed: every group keeps its position (its epoch, its order,
  the records it already drew); the draws after the restore use the new weights;
- groups added after the existing ones start at their epoch 0 (a logical shard that
  had run out of records serves theirs);
- the last groups removed leave the state; their buffered and carried samples are
  not packed, and one warning names each group and counts them;
- records appended to a group's data (lines to a JSONL, parquet files to a folder,
  a dataset to the group): each logical shard finishes the epoch it is in over the
  records it started with, each once, and the grown set joins from its next epoch
  (`packing.eras` keeps the earlier sets). Telling appended from rewritten takes
  the file lists a checkpoint keeps (`saved_manifests`); without them it is refused.

A group's randomness (record order, family choices, dropout) is keyed by its
position in `grouped_datasets`, so a group in the middle cannot come or go without
changing the others' streams: retire one by setting its weight to 0 instead.
Records removed or rewritten (a file deleted, shrunk, or changed under its name)
are refused in both modes, naming the dataset and the files (docs/changes.md).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Any, Mapping, Sequence

from bagel_grain.errors import StateMismatchError
from bagel_grain.sources import manifest

_log = logging.getLogger(__name__)
EMPTY = [-1, -1]  # an unused slot of a saved buffer (packing/pack.py)


@dataclasses.dataclass(frozen=True)
class Changes:
  """The differences between a saved fingerprint and ours (both flat: dotted keys)."""

  changed: Sequence[str]
  saved: Mapping[str, Any]
  ours: Mapping[str, Any]
  saved_groups: Sequence[str]
  our_groups: Sequence[str]
  saved_manifests: Mapping[str, Mapping[str, manifest.Manifest]]
  our_manifests: Mapping[str, Mapping[str, manifest.Manifest]]

  @property
  def common(self) -> int:
    """How many groups both have, position by position."""
    n = 0
    while (n < min(len(self.saved_groups), len(self.our_groups))
           and self.saved_groups[n] == self.our_groups[n]):
      n += 1
    return n

  @property
  def regrouped(self) -> bool:
    """Groups were added or removed at the end (the only moves allowed)."""
    n = self.common
    return n in (len(self.saved_groups), len(self.our_groups)) and (
        len(self.saved_groups) != len(self.our_groups))

  def moved_groups(self) -> set[str]:
    """Groups that came or went at the end."""
    n = self.common
    return set(self.saved_groups[n:]) | set(self.our_groups[n:]) if self.regrouped else set()


def applied(stages: dict[str, Any], changes: Changes, *, allow: bool) -> dict[str, Any]:
  """`stages` (the state's part under the envelope) for our stream, or StateMismatchError
  naming every difference that cannot be continued (or, without `allow`, every one)."""
  allowed, refused, data, appended = _classified(changes)
  problems = []
  if refused:
    problems.append("; ".join(refused))
  if data:
    hint = ("" if changes.saved_manifests else
            "; telling records appended from records rewritten takes the file lists the state "
            "was saved on: restore through bagel_grain.jax.restore, or pass `saved_manifests` "
            "to set_state")
    problems.append("the data changed under the state: " + "; ".join(data) + ". A run "
                    "continues only over the records it started with, and records appended "
                    "to them (with allow_changes=True)" + hint + ". Restore the data, or start "
                    "a new stream (without the state)")
  if allowed and not allow:
    problems.append("; ".join(allowed) + ". To continue across these (the next stage of "
                    "training), restore with allow_changes=True (docs/changes.md)")
  if problems:
    raise StateMismatchError(
        "the saved state belongs to a different stream (" + ". ".join(problems) + "). Restore "
        "with the same config, data, tokenizer, seed and logical shards (without "
        "`logical_shards`: the same process count), or start without the state.")
  if changes.regrouped:
    stages = _regrouped(stages, changes.saved_groups, changes.our_groups)
  for group in appended:
    stages = _grown(stages, changes, group)
  return stages


def _name(key: str) -> str:
  """A fingerprint key as the config spells it."""
  if key.startswith("config.groups."):
    return "grouped_datasets." + key[len("config.groups."):]
  return key


def _classified(changes: Changes) -> tuple[list[str], list[str], list[str], list[str]]:
  """(allowed with allow_changes, refused in any case, data changes by dataset refused,
  groups whose records were appended to)."""
  moved = changes.moved_groups()
  allowed, refused, datasets = [], [], {}
  if not changes.regrouped and list(changes.saved_groups) != list(changes.our_groups):
    refused.append(f"the groups were {list(changes.saved_groups)} and are "
                   f"{list(changes.our_groups)}: groups are matched by position, so add "
                   "groups after the existing ones, remove only the last ones, or set a "
                   "group's weight to 0 to retire it")
  for key in changes.changed:
    parts = key.split(".")
    detail = (f"{_name(key)}: saved {changes.saved.get(key, '(none)')!r}, "
              f"now {changes.ours.get(key, '(none)')!r}")
    if parts[0] == "data" and len(parts) >= 4:
      if parts[1] in moved:
        continue  # part of the group's coming or going
      # data.<group>.<dataset>.<field>: a dataset's name may hold dots, a family's not.
      datasets.setdefault((parts[1], key[len(f"data.{parts[1]}."):].rsplit(".", 1)[0]), None)
    elif key.startswith("config.groups.") and len(parts) >= 3:
      if parts[2] in moved:
        verb = "added" if parts[2] in changes.our_groups else "removed"
        line = f"group {parts[2]!r} {verb}"
        if line not in allowed:
          allowed.append(line)
      elif parts[2] in changes.saved_groups and parts[2] in changes.our_groups and (
          parts[3:] == ["weight"]):
        allowed.append(detail)
      elif parts[3:] == ["datasets"] and _datasets_added(changes.saved.get(key),
                                                         changes.ours.get(key)):
        continue  # each dataset added is named with the data below
      elif parts[2] in changes.saved_groups and parts[2] in changes.our_groups:
        refused.append(detail)
    else:
      refused.append(detail)
  appended, data = [], []
  for group, dataset in datasets:
    what = _appended(changes, group, dataset)
    if what is None:
      data.append(_dataset_changes(changes, group, dataset))
      continue
    allowed.append(f"group {group!r}, " + manifest.describe(
        dataset, changes.our_manifests.get(group, {}).get(dataset), [f"records appended ({what})"]))
    if group not in appended:
      appended.append(group)
  return allowed, refused, data, appended


def _datasets_added(saved: Any, ours: Any) -> bool:
  """Whether a group's datasets ([name, num_used_data, format] each) are the saved ones
  with others added, the saved in their order."""
  if not isinstance(saved, list) or not isinstance(ours, list):
    return False
  rest = iter(json.dumps(d) for d in ours)
  return all(json.dumps(d) in rest for d in saved)


def _appended(changes: Changes, group: str, dataset: str) -> str | None:
  """What was appended to a dataset ("dataset added", "sft.jsonl: 6 lines appended"), or
  None when its records were removed or rewritten, or the file lists to tell are not at
  hand (`manifest.appended`)."""
  prefix = f"data.{group}.{dataset}."
  if not any(k.startswith(prefix) for k in changes.saved):
    return "dataset added" if any(k.startswith(prefix) for k in changes.ours) else None
  saved = changes.saved_manifests.get(group, {}).get(dataset)
  ours = changes.our_manifests.get(group, {}).get(dataset)
  if saved is None or ours is None:
    return None
  formats = {d[0]: d[2] for d in changes.ours.get(f"config.groups.{group}.datasets") or ()
             if isinstance(d, list) and len(d) == 3}
  return manifest.appended(saved, ours, str(formats.get(dataset)))


def _grown(stages: dict[str, Any], changes: Changes, group: str) -> dict[str, Any]:
  """`stages` with the group's saved records as an earlier set (`packing.eras`): each
  shard's next set starts at the first epoch it has not begun (null until the pipeline
  resolves it)."""
  prefix = f"data.{group}."
  summaries: dict[str, dict[str, Any]] = {}
  for key, value in changes.saved.items():
    if key.startswith(prefix):
      dataset, field = key[len(prefix):].rsplit(".", 1)
      summaries.setdefault(dataset, {})[field] = value
  data_eras = dict(_mapping(stages.get("data_eras")))
  data_eras[group] = list(data_eras.get(group, [])) + [summaries]
  shards = {}
  for shard, entry in _mapping(stages.get("shards")).items():
    entry = dict(_mapping(entry))
    eras = dict(_mapping(entry.get("eras")))
    eras[group] = list(eras.get(group, [])) + [None]
    shards[shard] = {**entry, "eras": eras}
  return {**stages, "data_eras": data_eras, "shards": shards}

def _dataset_changes(changes: Changes, group: str, dataset: str) -> str:
  saved = changes.saved_manifests.get(group, {}).get(dataset)
  ours = changes.our_manifests.get(group, {}).get(dataset)
  prefix = f"data.{group}.{dataset}."
  if not any(k.startswith(prefix) for k in changes.saved):
    return f"group {group!r}: dataset {dataset!r} added"
  if not any(k.startswith(prefix) for k in changes.ours):
    return f"group {group!r}: dataset {dataset!r} removed"
  if saved is not None and ours is not None:
    found = manifest.changes(saved, ours)
  else:
    summary = {k: {f: changes.saved.get(prefix + f) if k == "saved" else changes.ours.get(
        prefix + f) for f in ("files", "bytes", "blocks", "digest", manifest.CONTENT)}
               for k in ("saved", "ours")}
    found = manifest.summary_changes(summary["saved"], summary["ours"])
    if ours is not None and len(ours.files) == 1 and summary["saved"]["files"] == 1:
      found = [f"{ours.files[0][0]}: {'; '.join(found)}"]  # one file: it is the one
  used = _num_used_data(changes, group, dataset)
  if used is not None:
    found = [*found, f"the dataset reads `num_used_data` ({used}) of its records, so records "
             "appended to it are not continued over, even with allow_changes=True (which "
             "records it reads may be others now): start a new stream (without the state) to "
             "take them in, or leave `num_used_data` out"]
  return f"group {group!r}, " + manifest.describe(dataset, ours, found)


def _num_used_data(changes: Changes, group: str, dataset: str) -> Any:
  """The dataset's `num_used_data` in our config (None when unset)."""
  for entry in changes.ours.get(f"config.groups.{group}.datasets") or ():
    if isinstance(entry, list) and len(entry) == 3 and entry[0] == dataset:
      return entry[1]
  return None


def _regrouped(stages: dict[str, Any], saved: Sequence[str],
               ours: Sequence[str]) -> dict[str, Any]:
  """The state's shards for our groups: the common ones keep everything, added ones start
  empty, removed ones leave (their waiting samples counted in one warning)."""
  n = min(len(saved), len(ours))
  lost = collections.Counter()
  shards = {}
  for shard, entry in _mapping(stages.get("shards")).items():
    entry = dict(_mapping(entry))
    packer = dict(_mapping(entry.get("packer")))
    next_index = packer.get("next_index")
    if isinstance(next_index, list):  # else left as it is: parsing names it
      packer["next_index"] = next_index[:n] + [0] * (len(ours) - n)
    for field in ("buffer", "carried"):
      keys = packer.get(field)
      if not isinstance(keys, list):
        continue  # malformed: parsing names it
      keep = []
      for key in keys:
        if key == EMPTY:
          continue
        if (isinstance(key, list) and key and isinstance(key[0], int)
            and n <= key[0] < len(saved)):
          lost[saved[key[0]]] += 1
        else:
          keep.append(key)  # ours, or malformed: parsing names it
      packer[field] = keep  # read as a list of the samples alone, as version 2 wrote it
    packer["stats"] = _regrouped_stats(_mapping(packer.get("stats")), ours)
    entry["packer"] = packer
    if len(ours) > n:
      entry["ended"] = False  # a shard whose groups ran out has the new groups' records
    if "eras" in entry:  # the record sets of groups that left go with them
      entry["eras"] = {g: e for g, e in _mapping(entry["eras"]).items() if g in ours}
    shards[shard] = entry
  for group in saved[n:]:
    _log.warning("group %r left the stream at this restore (allow_changes): %d of its samples "
                 "waiting in the packer's buffer are not packed", group, lost[group])
  out = {**stages, "shards": shards}
  if "data_eras" in stages:
    out["data_eras"] = {g: e for g, e in _mapping(stages["data_eras"]).items() if g in ours}
  return out


def _regrouped_stats(stats: Mapping[str, Any], ours: Sequence[str]) -> dict[str, Any]:
  """Per-group counters for our groups: kept by name, new groups at zero."""
  out = dict(stats)
  width = len(stats.get("drop_reasons", ()))
  for field in ("counts", "drops", "notes", "missing_mandatory"):
    if not isinstance(stats.get(field), Mapping):
      continue  # malformed: parsing names it
    before = stats[field]
    fresh = {"drops": [0] * width if "drop_reasons" in stats else {},
             "missing_mandatory": 0}.get(field, {})
    out[field] = {g: before.get(g, fresh) for g in ours}
  return out


def _mapping(value: Any) -> Mapping[str, Any]:
  return value if isinstance(value, Mapping) else {}
