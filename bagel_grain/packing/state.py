"""The iterator state's envelope: a version and the stream's fingerprint, checked first.

Inside the envelope the stages keep their own keys (packing/shards.py per logical
shard, then packing/pack.py, packing/mix.py); the whole is plain JSON of a few
hundred bytes per shard, whatever the buffers hold. Version 1 (release 0.1.0, one
process's packing state) is read as the single shard of its process.
"""

from __future__ import annotations

from typing import Any

from bagel_grain.errors import StateMismatchError

STATE_VERSION = 2


def sealed(state: dict[str, Any], fingerprint: dict[str, Any]) -> dict[str, Any]:
  """`state` inside the envelope: version and fingerprint first."""
  return {"version": STATE_VERSION, "fingerprint": dict(fingerprint), **state}


def _from_version_1(state: dict[str, Any]) -> dict[str, Any]:
  """A version-1 state (one process's packing state) as the one logical shard it was."""
  fingerprint = dict(state.get("fingerprint", {}))
  shard, count = fingerprint.pop("process_index", None), fingerprint.pop("process_count", None)
  packer = {k: v for k, v in state.items() if k not in ("version", "fingerprint")}
  return {"version": STATE_VERSION, "fingerprint": {**fingerprint, "logical_shards": count},
          "logical_shards": count, "shards": {str(shard): {
              "rows": int(packer["stats"]["rows"]), "ended": False, "packer": packer}}}


def opened(state: dict[str, Any], fingerprint: dict[str, Any]) -> dict[str, Any]:
  """The stages' part of a saved state, once its version and fingerprint match ours."""
  if state.get("version") == 1:
    state = _from_version_1(state)
  if state.get("version") != STATE_VERSION:
    raise StateMismatchError(f"iterator state version {state.get('version')!r}; this "
                             f"bagel_grain reads version {STATE_VERSION}")
  saved = state.get("fingerprint", {})
  changed = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
  if changed:
    detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {fingerprint.get(k)!r}"
                       for k in changed)
    raise StateMismatchError(
        f"the saved state belongs to a different stream ({detail}). Restore with the "
        "same config, tokenizer, seed and logical shards (without `logical_shards`: the same "
        "process count), or start without the state.")
  return {k: v for k, v in state.items() if k not in ("version", "fingerprint")}
