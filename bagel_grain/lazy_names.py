"""Package names that load their module on first use (PEP 562), so that importing a
package costs nothing until one of its names is asked for."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, homes: dict[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
  """The package's `__getattr__`: imports `homes[name]`, keeps the value in the
  package's namespace (later lookups skip this), and refuses names it does not know."""

  def __getattr__(name: str) -> Any:
    if name not in homes:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(homes[name]), name)
    namespace[name] = value
    return value

  return __getattr__
