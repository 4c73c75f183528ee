"""The Beam tests run in the Beam venv (`make test`); they compare with the loader's venv.

`loader_cli(*args)` runs `bagel-grain` with the loader's own interpreter (`.venv`, or
`BAGEL_GRAIN_LOADER_PYTHON`), so a test can compare what the two environments write.
"""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def loader_python() -> str:
  python = os.environ.get("BAGEL_GRAIN_LOADER_PYTHON", str(REPO / ".venv" / "bin" / "python"))
  if not os.path.exists(python):
    pytest.fail(f"no loader venv at {python}: run `make install` (or set "
                "BAGEL_GRAIN_LOADER_PYTHON) to compare the Beam venv's output with it")
  return python


@pytest.fixture(scope="session")
def loader_cli(loader_python):
  def run(*args: str) -> str:
    done = subprocess.run([loader_python, "-m", "bagel_grain.tooling.cli", *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
  return run
