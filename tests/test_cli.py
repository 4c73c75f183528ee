"""The command line on the demo data: demo, bench (smoke), convert."""

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from bagel_grain import cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture
def demo_yaml(demo_dir, tmp_path):
  """configs/demo.yaml as a file pointing at the generated demo data."""
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw["dataset_info"] = str(demo_dir / "dataset_info.yaml")
  raw["tokenizer_path"] = str(demo_dir / "tokenizer")
  path = tmp_path / "demo.yaml"
  path.write_text(yaml.safe_dump(raw))
  return path


def test_demo_reports_fill_shares_drops_and_state(demo_yaml, capsys):
  assert cli.main(["demo", "--config", str(demo_yaml), "--batches", "4"]) == 0
  out = capsys.readouterr().out
  for expected in ("fill (real tokens / L)", "t2i_pretrain", "unified_edit", "vlm_sft",
                   "drops by reason", "accounting: drawn", "iterator state:"):
    assert expected in out
  drawn = out.split("accounting: drawn ")[1].split()
  # "drawn D = packed P + dropped X + buffered B + carried C"
  d, p, x, b, c = (int(drawn[i]) for i in (0, 3, 6, 9, 12))
  assert d == p + x + b + c


def test_bench_smoke_emits_every_field(demo_yaml, tmp_path, capsys):
  report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
  assert cli.main(["bench", "--config", str(demo_yaml), "--workers", "0", "--seconds", "2",
                   "--windows", "2", "--json", str(report_path), "--plot", str(plot_path)]) == 0
  report = json.loads(report_path.read_text())
  run = report["runs"][0]
  for field in ("packed_tokens_per_s", "image_tokens_per_s", "ratio_to_floor",
                "first_batch_s", "restore_s", "state_bytes", "peak_rss_main_mib",
                "peak_rss_worker_mib", "row_fill", "vit_slot_use", "vae_token_slot_use",
                "vae_image_slot_use", "main_process_time_share", "speedup_vs_0_workers"):
    assert field in run, field
  assert run["image_tokens_per_s"] > 0 and 0 < run["row_fill"] <= 1
  assert report["floor"]["image_tokens_per_s"] > 0
  assert report["floor"]["parquet_bytes_read_per_byte_used"] > 0
  assert set(report["jpeg_draft"]) >= {"speedup", "mean_abs_diff", "max_abs_diff"}
  assert Image.open(plot_path).size == (640, 400)
  assert "x floor" in capsys.readouterr().out


def test_convert_then_demo_on_array_record(demo_yaml, tmp_path, capsys):
  out = tmp_path / "ar"
  assert cli.main(["convert", "--config", str(demo_yaml), "--out", str(out)]) == 0
  assert cli.main(["demo", "--config", str(out / "config.yaml"), "--batches", "2"]) == 0
  assert "accounting: drawn" in capsys.readouterr().out
