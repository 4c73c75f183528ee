"""Typed values read from a config mapping, each error naming the file, the group and the key.

Shared by `config.py` and the group options a family declares (`families.family.GroupOptions`).
"""

from __future__ import annotations

import difflib
import numbers
import reprlib
from typing import Any, Mapping

from bagel_grain.errors import ConfigError

# Not from config_yaml: a worker process loads the families (which check their options
# here) but never reads YAML, and PyYAML's import is ~25 ms of each worker's start-up.
_SHOWN_CHARS = 80

_repr = reprlib.Repr()
for _limit, _value in (("maxlevel", 3), ("maxlist", 4), ("maxdict", 4), ("maxtuple", 4),
                       ("maxset", 4), ("maxstring", 60), ("maxlong", 40), ("maxother", 60)):
  setattr(_repr, _limit, _value)


def shown(value: Any) -> str:
  """`repr(value)` cut to a line: walks at most a few elements at a few levels."""
  text = _repr.repr(value)
  return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def number(value: Any, kind: type, *, file: str, group: str | None, key: str):
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if kind is int:
    ok = ok and float(value).is_integer()
  if not ok:
    raise ConfigError(f"`{key}` must be a {'whole number' if kind is int else 'number'}, "
                      f"got {shown(value)}", file=file, group=group, key=key)
  return kind(value)


def check_range(value: float, least: float | None, greatest: float | None, *, file: str,
                group: str | None, key: str) -> None:
  if not ((least is None or value >= least) and (greatest is None or value <= greatest)):
    bounds = (f"between {least} and {greatest}" if least is not None and greatest is not None
              else f">= {least}" if least is not None else f"<= {greatest}")
    raise ConfigError(f"`{key}` must be {bounds}, got {shown(value)}", file=file, group=group,
                      key=key)


def key_name(key: Any) -> str:
  """A key as error messages name it: itself when a short string, else its short repr."""
  return key if isinstance(key, str) and len(key) <= 80 else shown(key)


def close_key(key: Any, allowed) -> str | None:
  """The allowed key an unknown `key` is a typo of, if one is close enough."""
  if not isinstance(key, str) or len(key) > 200:
    return None
  close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.75)
  return close[0] if close else None


def did_you_mean(key: Any, allowed) -> str:
  """The end of an unknown key's message: the closest allowed key when one is close (a
  typo), else the allowed keys."""
  close = close_key(key, allowed)
  return f"did you mean `{close}`?" if close else f"allowed: {sorted(allowed)}"


def check_keys(mapping: Mapping, allowed: set[str], *, file: str, group: str | None,
               where: str):
  for key in mapping:
    if key not in allowed:
      raise ConfigError(f"unknown key in {where}; {did_you_mean(key, allowed)}",
                        file=file, group=group, key=key_name(key))
