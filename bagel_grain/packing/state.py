"""The iterator state's envelope, and the checks every stage runs on its part of a state.

The envelope is a version and the stream's fingerprint, checked first. Inside it
the stages keep their own keys (packing/shards.py per logical shard, then
packing/pack.py, packing/mix.py); the whole is plain JSON of fixed structure for a
given config and process count (lists of fixed length, every counter present),
as Grain's checkpoint contract asks. Version 2 held only what was in use (lists
as long as their content, counters when non-zero) and reads as it is; version 1
(release 0.1.0, one process's packing state) is read as the single shard of its
process. Version 4 is version 3 plus the earlier record sets of groups whose
records were appended at a restore (packing/eras.py): written only then, so that a
release that cannot continue over them refuses it. A stage parses its
keys with the helpers below before it changes anything, so a malformed state is
a StateMismatchError naming the field, and the iterator stays where it was.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping, Sequence

from bagel_grain.errors import StateMismatchError
from bagel_grain.packing import continuation, shares
from bagel_grain.sources.manifest import CONTENT, Manifest

STATE_VERSION = 3
ERAS_VERSION = 4  # a state holding earlier record sets (`packing.eras`): older readers refuse it
READABLE_VERSIONS = (1, 2, 3, 4)  # 2: lists and counters hold only what is used


def sealed(state: dict[str, Any], fingerprint: dict[str, Any]) -> dict[str, Any]:
  """`state` inside the envelope: version and fingerprint first."""
  version = ERAS_VERSION if "data_eras" in state else STATE_VERSION
  return {"version": version, "fingerprint": dict(fingerprint), **state}


def _from_version_1(state: Mapping[str, Any]) -> dict[str, Any]:
  """A version-1 state (one process's packing state) as the one logical shard it was."""
  fingerprint = dict(mapping(state.get("fingerprint"), "fingerprint"))
  shard, count = fingerprint.pop("process_index", None), fingerprint.pop("process_count", None)
  packer = {k: v for k, v in state.items() if k not in ("version", "fingerprint")}
  stats = packer.get("stats")
  rows = stats.get("rows") if isinstance(stats, Mapping) else None  # checked with the shard
  return {"version": 2, "fingerprint": {**fingerprint, "logical_shards": count},
          "logical_shards": count, "shards": {str(shard): {
              "rows": rows, "ended": False, "packer": packer}}}


@dataclasses.dataclass(frozen=True)
class StreamIdentity:
  """What a saved state must match to continue this stream.

  `fingerprint`: what shapes the stream, field by field, the data's summaries under
  `data`. `legacy`: the fingerprint versions 1 and 2 wrote (each group one hash, no
  data). `defaults`: per config field (dotted, as `fingerprint` nests it), the value
  a state saved before the field existed stands for. `manifests`: per group and
  dataset, the data this pipeline reads (a checkpoint keeps them, to name files).
  """

  fingerprint: dict[str, Any]
  legacy: dict[str, Any] | None = None
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  manifests: Mapping[str, Mapping[str, Manifest]] = dataclasses.field(default_factory=dict)


def opened(state: Any, identity: StreamIdentity, *, allow_changes: bool = False,
           saved_manifests: Mapping[str, Mapping[str, Manifest]] | None = None
           ) -> dict[str, Any]:
  """The stages' part of a saved state, once its version and fingerprint match ours.

  The fingerprint is compared field by field (nested mappings by their dotted
  keys), and the error names every field that differs, and every dataset whose
  files changed (by file when `saved_manifests` are given). With `allow_changes`,
  the changes `continuation` allows (weights, groups added or removed at the end)
  are applied to the state instead (docs/changes.md).
  """
  mapping(state, "state")
  if state.get("version") == 1:
    state = _from_version_1(state)
  version = state.get("version")
  if version not in READABLE_VERSIONS:
    raise StateMismatchError(f"iterator state version {version!r}; this "
                             f"bagel_grain reads versions {list(READABLE_VERSIONS)}")
  saved_tree = mapping(state.get("fingerprint"), "fingerprint")
  ours_tree = identity.fingerprint if version >= 3 or identity.legacy is None else identity.legacy
  saved, ours = _flat(saved_tree), _flat(ours_tree)
  changed = sorted(k for k in set(saved) | set(ours)
                   if saved.get(k, _ABSENT) != ours.get(k, _ABSENT)
                   and not (k not in saved and k in identity.defaults
                            and ours[k] == identity.defaults[k])
                   and not _content_unknown(k, saved, ours))
  changed = _weights_as_shares(changed, saved, ours, _group_names(saved_tree),
                               _group_names(ours_tree))
  stages = {k: v for k, v in state.items() if k not in ("version", "fingerprint")}
  if not changed:
    return stages
  return continuation.applied(stages, continuation.Changes(
      changed=changed, saved=saved, ours=ours,
      saved_groups=_group_names(saved_tree), our_groups=_group_names(ours_tree),
      saved_manifests=saved_manifests or {}, our_manifests=identity.manifests),
      allow=allow_changes)


_ABSENT = object()


def _weights_as_shares(changed: list[str], saved: Mapping[str, Any], ours: Mapping[str, Any],
                       saved_groups: list[str], our_groups: list[str]) -> list[str]:
  """`changed` less the groups' weights when only their scale changed (`packing.shares`)."""
  keys = [f"config.groups.{g}.weight" for g in our_groups]
  if saved_groups != our_groups or not set(keys) & set(changed):
    return changed
  weights = [[side.get(k) for k in keys] for side in (saved, ours)]
  if not all(isinstance(w, (int, float)) and not isinstance(w, bool)
             for side in weights for w in side):
    return changed  # a damaged or missing weight: named as a change
  same = shares.same_draws(*weights)
  return [k for k in changed if k not in keys] if same else changed


def _content_unknown(key: str, saved: Mapping[str, Any], ours: Mapping[str, Any]) -> bool:
  """A dataset's content checksums (`manifest.CONTENT`) known on one side only: data not
  indexed on the other, or a state saved before them. Sizes still compare."""
  return (key.startswith("data.") and key.endswith("." + CONTENT)
          and (key not in saved or key not in ours))


def _group_names(fingerprint: Mapping[str, Any]) -> list[str]:
  """The groups in their config order (a fingerprint lists them so)."""
  config = fingerprint.get("config")
  groups = config.get("groups") if isinstance(config, Mapping) else None
  return list(groups) if isinstance(groups, Mapping) else []


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


# --- parsing a stage's keys ------------------------------------------------------------


def mapping(value: Any, field: str) -> Mapping[str, Any]:
  if not isinstance(value, Mapping):
    raise StateMismatchError(f"state field `{field}`: expected a mapping, got "
                             f"{type(value).__name__}")
  return value


def entry(state: Mapping[str, Any], key: str, field: str | None = None) -> Any:
  """`state[key]`; a missing key is an error naming `field` (default: the key)."""
  if key not in state:
    raise StateMismatchError(f"state field `{field or key}` is missing")
  return state[key]


def whole(value: Any, field: str, least: int = 0, greatest: int = sys.maxsize) -> int:
  """A whole number in [least, greatest] (not a bool, not a float)."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise StateMismatchError(f"state field `{field}`: expected a whole number, got {value!r}")
  if not least <= value <= greatest:
    raise StateMismatchError(f"state field `{field}`: {value} is outside [{least}, {greatest}]")
  return value


def sequence(value: Any, field: str, *, length: int | None = None,
             most: int | None = None) -> Sequence[Any]:
  """A list, of exactly `length` or at most `most` entries."""
  if not isinstance(value, list):
    raise StateMismatchError(f"state field `{field}`: expected a list, got "
                             f"{type(value).__name__}")
  if length is not None and len(value) != length:
    raise StateMismatchError(f"state field `{field}`: expected {length} entries, got "
                             f"{len(value)}")
  if most is not None and len(value) > most:
    raise StateMismatchError(f"state field `{field}`: {len(value)} entries, at most {most} "
                             "can be saved")
  return value


def counter(value: Any, field: str) -> dict[str, int]:
  """A mapping of names to counts >= 0."""
  out = {}
  for key, count in mapping(value, field).items():
    if not isinstance(key, str):
      raise StateMismatchError(f"state field `{field}`: key {key!r} is not a name")
    out[key] = whole(count, f"{field}.{key}")
  return out


def per_group(value: Any, field: str, names: Sequence[str]) -> Mapping[str, Any]:
  """A mapping with exactly one entry per group name."""
  value = mapping(value, field)
  if set(value) != set(names):
    raise StateMismatchError(f"state field `{field}`: expected the groups {sorted(names)}, "
                             f"got {sorted(map(str, value))}")
  return value
