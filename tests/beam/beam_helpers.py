"""What the Beam tests share: the Beam venv's CLI, a demo copy with its config, file trees."""

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from bagel_grain.configs import shipped_path

# Two worker processes, as the DirectRunner command line has them.
MULTI = ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]


def beam_cli(*args: str) -> str:
  """`bagel-grain` in this (the Beam) venv, as a user runs it."""
  done = subprocess.run([sys.executable, "-m", "bagel_grain.tooling.cli", *args],
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def demo_copy(demo_dir: Path, dest: Path) -> Path:
  """The demo data copied with its files' times (an index stays fresh), and its config."""
  shutil.copytree(demo_dir, dest / "data")
  raw = yaml.safe_load(shipped_path("demo").read_text())
  raw["dataset_info"] = str(dest / "data" / "dataset_info.yaml")
  raw["tokenizer_path"] = str(dest / "data" / "tokenizer")
  # Three t2i files of two (one repeated) and 50 of the VLM lines: what convert applies.
  raw["grouped_datasets"]["t2i_pretrain"]["num_used_data"] = [3]
  raw["grouped_datasets"]["vlm_sft"]["num_used_data"] = [50]
  config = dest / "config.yaml"
  config.write_text(yaml.safe_dump(raw))
  return config


def tree_bytes(root: Path) -> dict[str, bytes]:
  """{relative path: content} of every file under `root`."""
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
          if p.is_file()}
