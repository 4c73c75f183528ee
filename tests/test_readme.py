"""Every ```python block of README.md and of each docs/*.md page runs as written, as its
own script.

Each block runs in a fresh interpreter from a folder laid out like the
repository root after `make demo`: `configs/` (a copy of ours) and `.demo_data/`
(the generated demo data). Placeholders a page marks as the user's own are
swapped for test values before the run; each must appear in exactly one block, so
the table cannot go stale silently. A page without a python block is fine.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.M | re.S)


# (page relative to the root, block number in the page, code), README first.
BLOCKS = [(page.relative_to(ROOT).as_posix(), i, code)
          for page in PAGES for i, code in enumerate(python_blocks(page))]

# Page placeholder -> what the test runs instead (a `str.format` template over `root`).
PLACEHOLDERS = {
    'CKPT_DIR = "/tmp/bagel_grain_ckpt"': 'CKPT_DIR = "{root}/ckpt"',
}


@pytest.fixture(scope="module")
def repo_like_root(demo_dir, tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("readme")
  shutil.copytree(ROOT / "configs", root / "configs")
  (root / ".demo_data").symlink_to(demo_dir, target_is_directory=True)
  return root


def test_readme_starts_with_the_two_commands():
  top = (ROOT / "README.md").read_text().splitlines()[:40]
  for command in ("make demo", "make test"):
    assert any(line.startswith(command) for line in top), command


def test_readme_has_python_blocks_and_every_placeholder_is_used():
  assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 2
  for placeholder in PLACEHOLDERS:
    assert sum(placeholder in code for _, _, code in BLOCKS) == 1, placeholder


def test_every_docs_page_is_collected():
  assert {p.name for p in PAGES} >= {"README.md", "architecture.md", "configuration.md"}
  assert len({page for page, _, _ in BLOCKS}) >= 2  # the docs' blocks run too


@pytest.mark.parametrize("page, index, code", BLOCKS,
                         ids=[f"{page}-{index}" for page, index, _ in BLOCKS])
def test_page_block_runs(page, index, code, repo_like_root):
  for placeholder, value in PLACEHOLDERS.items():
    code = code.replace(placeholder, value.format(root=repo_like_root))
  script = repo_like_root / f"{Path(page).stem}_block_{index}.py"
  script.write_text(code)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
  done = subprocess.run([sys.executable, script.name], cwd=repo_like_root, env=env,
                        capture_output=True, text=True, timeout=300)
  report = f"{page} block {index}:\n{code}\n--- stderr ---\n{done.stderr}"
  assert done.returncode == 0, report
  assert "Traceback" not in done.stderr, report  # e.g. a worker that died re-running the script
  if 'CKPT_DIR = "' in code:  # the checkpoint went to the test's folder, at every save step
    assert sorted(p.name for p in (repo_like_root / "ckpt").iterdir()) == ["2", "4"]
