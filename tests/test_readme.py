"""Every ```python block of README.md runs as written, as its own script.

Each block runs in a fresh interpreter from a folder laid out like the
repository root after `make demo`: `configs/` (a copy of ours) and `.demo_data/`
(the generated demo data). Placeholders the README marks as the user's own are
swapped for test values before the run; each must appear in the README, so the
table cannot go stale silently.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.M | re.S)

# README placeholder -> what the test runs instead (a `str.format` template over `root`).
PLACEHOLDERS = {
    'CKPT_DIR = "/tmp/bagel_grain_ckpt"': 'CKPT_DIR = "{root}/ckpt"',
}


@pytest.fixture(scope="module")
def repo_like_root(demo_dir, tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("readme")
  shutil.copytree(ROOT / "configs", root / "configs")
  (root / ".demo_data").symlink_to(demo_dir, target_is_directory=True)
  return root


def test_readme_has_python_blocks_and_every_placeholder_is_used():
  assert len(BLOCKS) >= 2
  for placeholder in PLACEHOLDERS:
    assert sum(placeholder in b for b in BLOCKS) == 1, placeholder


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, repo_like_root):
  code = BLOCKS[index]
  for placeholder, value in PLACEHOLDERS.items():
    code = code.replace(placeholder, value.format(root=repo_like_root))
  script = repo_like_root / f"readme_block_{index}.py"
  script.write_text(code)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
  done = subprocess.run([sys.executable, script.name], cwd=repo_like_root, env=env,
                        capture_output=True, text=True, timeout=300)
  report = f"README block {index}:\n{code}\n--- stderr ---\n{done.stderr}"
  assert done.returncode == 0, report
  assert "Traceback" not in done.stderr, report  # e.g. a worker that died re-running the script
  if 'CKPT_DIR = "' in code:  # the checkpoint went to the test's folder, at every save step
    assert sorted(p.name for p in (repo_like_root / "ckpt").iterdir()) == ["2", "4"]
