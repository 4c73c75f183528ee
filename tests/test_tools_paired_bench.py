"""tools/paired_bench.py: its run order, its config pointing and its medians."""

import collections
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, strategies as st

from bagel_grain.config import load_config

TOOL = Path(__file__).resolve().parents[1] / "tools" / "paired_bench.py"
_spec = importlib.util.spec_from_file_location("paired_bench", TOOL)
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)


@given(st.integers(1, 6), st.lists(st.integers(0, 16), min_size=1, max_size=4, unique=True))
def test_every_tree_runs_once_per_round_and_worker_count_beside_the_other(rounds, workers):
  runs = paired.schedule(rounds, workers)
  assert collections.Counter(runs) == collections.Counter(
      (r, w, t) for r in range(rounds) for w in workers for t in ("old", "new"))
  for first, second in zip(runs[::2], runs[1::2]):  # the pair of one round and worker count
    assert first[:2] == second[:2] and {first[2], second[2]} == {"old", "new"}


@given(st.integers(2, 6), st.integers(0, 16))
def test_the_tree_that_runs_first_alternates_from_round_to_round(rounds, workers):
  firsts = [t for r, w, t in paired.schedule(rounds, [workers])[::2]]
  assert all(a != b for a, b in zip(firsts, firsts[1:]))


def test_a_pointed_bench_config_loads_on_the_given_data(demo_dir, tmp_path):
  shipped = Path(__file__).resolve().parents[1] / "bagel_grain" / "configs" / "demo.yaml"
  raw = yaml.safe_load(shipped.read_text())
  pointed = paired.pointed_config(raw, str(demo_dir))
  assert {k: v for k, v in pointed.items() if k not in ("tokenizer_path", "dataset_info")} == \
      {k: v for k, v in raw.items() if k not in ("tokenizer_path", "dataset_info")}
  path = tmp_path / "elsewhere" / "demo.yaml"  # far from the data: only absolute paths work
  path.parent.mkdir()
  path.write_text(yaml.safe_dump(pointed))
  cfg = load_config(str(path))
  assert Path(cfg.tokenizer_path) == demo_dir / "tokenizer"
  assert [g.name for g in cfg.groups] == list(raw["grouped_datasets"])


def _run(tree, workers, packed, rss_main, floor=None):
  return {"tree": tree, "workers": workers, "packed_tokens_per_s": packed,
          "image_tokens_per_s": packed * 2, "first_batch_s": 0.5, "restore_s": 0.3,
          "peak_rss_main_mib": rss_main, "peak_rss_worker_mib": None if workers == 0 else 600,
          "cpu_s_per_mtoken": 5.0, "floor_ratio": floor}


def test_the_summary_takes_medians_over_rounds_and_compares_the_trees():
  runs = [_run("old", 0, 100, 700, 0.8), _run("old", 0, 120, 650, 0.9),
          _run("old", 0, 110, 900, 0.7), _run("new", 0, 210, 500, 0.95),
          _run("new", 0, 200, 520, 0.85), _run("new", 0, 220, 480, 0.9),
          _run("old", 2, 300, 800), _run("new", 2, 500, 600)]
  summary = paired.summarize(runs)
  old, new = summary["0"]["old"], summary["0"]["new"]
  assert (old["packed_tokens_per_s"], new["packed_tokens_per_s"]) == (110, 210)
  assert (old["peak_rss_main_mib"], new["peak_rss_main_mib"]) == (700, 500)
  assert old["rounds"] == 3
  assert summary["0"]["new/old"]["packed_tokens_per_s"] == pytest.approx(210 / 110)
  assert "peak_rss_worker_mib" not in old  # no workers, no worker figure
  assert "floor_ratio" not in summary["2"]["old"]  # measured at 0 workers only
  assert paired.scaling(summary, 2) == {"old": pytest.approx(300 / 110),
                                        "new": pytest.approx(500 / 210)}
  assert "2 workers / 0 workers" in paired.format_summary(summary, "abc1234")


def test_a_driver_refuses_a_tree_it_did_not_import(tmp_path):
  done = subprocess.run([sys.executable, str(TOOL), "--drive", str(tmp_path), "--data",
                         str(tmp_path), "--workers", "0"], capture_output=True, text=True,
                        timeout=120, check=False)
  assert done.returncode != 0
  assert f"not the tree {tmp_path}" in done.stderr
