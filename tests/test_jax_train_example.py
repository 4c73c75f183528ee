"""tools/train_example.py end to end: one compile of the train step, and resuming from an
Orbax checkpoint (model + iterator) reaches the loss of the uninterrupted run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_train_example():
  path = ROOT / "tools" / "train_example.py"
  spec = importlib.util.spec_from_file_location("train_example", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_train_example_compiles_once_and_resumes_exactly(demo_dir, tmp_path):
  raw = yaml.safe_load((ROOT / "bagel_grain" / "configs" / "demo.yaml").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  config = tmp_path / "demo.yaml"
  config.write_text(yaml.safe_dump(raw))

  results = load_train_example().main([
      "--config", str(config), "--steps", "3", "--ckpt-step", "1", "--batch-size", "8",
      "--max-num-tokens", "512", "--max-image-size", "64", "--workdir", str(tmp_path),
      "--quiet"])

  assert results["devices"] == 8 and results["global_batch"] == 8
  assert results["compiles"]["train_step"] == 1
  assert results["traces"]["train_step"] == 1  # the resumed run reused the compiled step
  assert results["backend_compiles_in_later_steps"] == 0
  assert len(results["losses"]) == len(results["resumed_losses"]) == 3
  assert results["resumed_final_loss"] == results["final_loss"]
  assert results["max_abs_loss_diff"] == 0.0
  assert (tmp_path / "train_example_checkpoints" / "1" / "data").is_dir()
