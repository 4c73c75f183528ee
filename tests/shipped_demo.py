"""The shipped demo config as a mapping, its data paths moved: for tests that edit either."""

from pathlib import Path

import yaml

from bagel_grain.configs import shipped_path


def shipped_demo_raw(demo_dir: Path, root: str | None = None) -> dict:
  """The shipped demo.yaml as a mapping, its data paths under `root` (default `demo_dir`)."""
  root = str(demo_dir) if root is None else root
  raw = yaml.safe_load(shipped_path("demo").read_text())
  info = yaml.safe_load((demo_dir / "dataset_info.yaml").read_text())
  for datasets in info.values():
    for entry in datasets.values():
      for key in ("data_dir", "jsonl_path", "parquet_info_path"):
        if key in entry:
          entry[key] = f"{root}/{entry[key]}"
  raw["dataset_info"] = info
  raw["tokenizer_path"] = f"{root}/tokenizer"
  return raw
