"""The iterator state's envelope, and the checks every stage runs on its part of a state.

The envelope is a version and the stream's fingerprint, checked first. Inside it
the stages keep their own keys (packing/shards.py per logical shard, then
packing/pack.py, packing/mix.py); the whole is plain JSON of fixed structure for a
given config and process count (lists of fixed length, every counter present),
as Grain's checkpoint contract asks. Version 2 held only what was in use (lists
as long as their content, counters when non-zero) and reads as it is; version 1
(release 0.1.0, one process's packing state) is read as the single shard of its
process. A stage parses its
keys with the helpers below before it changes anything, so a malformed state is
a StateMismatchError naming the field, and the iterator stays where it was.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

from bagel_grain.errors import StateMismatchError

STATE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 2: lists and counters hold only what is used


def sealed(state: dict[str, Any], fingerprint: dict[str, Any]) -> dict[str, Any]:
  """`state` inside the envelope: version and fingerprint first."""
  return {"version": STATE_VERSION, "fingerprint": dict(fingerprint), **state}


def _from_version_1(state: Mapping[str, Any]) -> dict[str, Any]:
  """A version-1 state (one process's packing state) as the one logical shard it was."""
  fingerprint = dict(mapping(state.get("fingerprint"), "fingerprint"))
  shard, count = fingerprint.pop("process_index", None), fingerprint.pop("process_count", None)
  packer = {k: v for k, v in state.items() if k not in ("version", "fingerprint")}
  stats = packer.get("stats")
  rows = stats.get("rows") if isinstance(stats, Mapping) else None  # checked with the shard
  return {"version": STATE_VERSION, "fingerprint": {**fingerprint, "logical_shards": count},
          "logical_shards": count, "shards": {str(shard): {
              "rows": rows, "ended": False, "packer": packer}}}


def opened(state: Any, fingerprint: dict[str, Any]) -> dict[str, Any]:
  """The stages' part of a saved state, once its version and fingerprint match ours.

  The fingerprint is compared field by field (nested mappings by their dotted
  keys), and the error names every field that differs.
  """
  mapping(state, "state")
  if state.get("version") == 1:
    state = _from_version_1(state)
  if state.get("version") not in READABLE_VERSIONS:
    raise StateMismatchError(f"iterator state version {state.get('version')!r}; this "
                             f"bagel_grain reads versions {list(READABLE_VERSIONS)}")
  saved = _flat(mapping(state.get("fingerprint"), "fingerprint"))
  ours = _flat(fingerprint)
  changed = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
  if changed:
    detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {ours.get(k)!r}" for k in changed)
    raise StateMismatchError(
        f"the saved state belongs to a different stream ({detail}). Restore with the "
        "same config, tokenizer, seed and logical shards (without `logical_shards`: the same "
        "process count), or start without the state.")
  return {k: v for k, v in state.items() if k not in ("version", "fingerprint")}


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
