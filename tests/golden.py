"""The upstream golden fixtures, kept in the repo under tests/golden/ (see its README.md)."""

import hashlib
import json
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent / "golden"


def load_json(name: str):
  """One golden JSON file, parsed."""
  return json.loads((GOLDEN / name).read_text())


def array_digest(a: np.ndarray) -> dict:
  """Shape and sha256 of a uint8 array's C-order bytes: equal digests mean equal arrays."""
  assert a.dtype == np.uint8, a.dtype
  digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
  return {"shape": list(a.shape), "sha256": digest}
