"""Where the shared golden fixtures live (override with BAGEL_GOLDEN_DIR)."""

import json
import os
from pathlib import Path

GOLDEN = Path(os.environ.get("BAGEL_GOLDEN_DIR",
                             Path(__file__).resolve().parents[2] / "shared" / "golden"))


def load_json(name: str):
  """One golden JSON file, parsed."""
  return json.loads((GOLDEN / name).read_text())
