"""The command line: demo, bench (smoke), convert on the demo data; errors, help, progress,
and the shipped configs found from any directory."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from bagel_grain.tooling import cli
from bagel_grain.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "bagel_grain" / "configs"  # the shipped demo.yaml


@pytest.fixture
def demo_yaml(demo_dir, tmp_path):
  """The shipped demo.yaml as a file pointing at the generated demo data."""
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
                "vae_image_slot_use", "main_process_time_share", "speedup_vs_0_workers",
                "main_cpu_s_per_row", "main_cpu_share", "host_rows_per_s_implied", "memory"):
    assert field in run, field
  assert run["image_tokens_per_s"] > 0 and 0 < run["row_fill"] <= 1
  # With no workers the main process decodes: busy, and each row costs it CPU.
  assert run["main_cpu_s_per_row"] > 0 and run["main_cpu_share"] > 0
  assert run["host_rows_per_s_implied"] == pytest.approx(1 / run["main_cpu_s_per_row"])
  assert run["main_decoded_samples"] > 0  # no workers: every sample
  assert 0 < run["main_decode_cpu_s_per_row"] < run["main_cpu_s_per_row"]
  by_thread = run["main_cpu_s_per_row_by_thread"]
  assert set(by_thread) == {"main", "pump", "decode", "other"}
  assert by_thread["decode"] > 0 and by_thread["pump"] == 0  # no workers: no pump thread
  assert sum(by_thread.values()) <= run["main_cpu_s_per_row"] * 1.1
  by_part = run["main_cpu_s_per_row_by_part"]  # the caller's thread split by what it does
  assert list(by_part) == ["pump", "placement", "row writing", "hand-off", "decoding", "other"]
  assert by_part["row writing"] > 0 and by_part["hand-off"] > 0 and by_part["pump"] == 0
  assert by_part["placement"] + by_part["row writing"] + by_part["hand-off"] == pytest.approx(
      by_thread["main"], abs=0.02)
  main = run["memory"]["main"]
  assert 0 < main["rss_after_imports_bytes"] and 0 < main["rss_bytes"]
  assert main["row_group_cache_bytes"] > 0  # the demo's T2I group is parquet
  assert main["batch_buffers"] >= 1 and main["batch_buffer_bytes"] > 0
  assert main["batches_into_reused_buffers"] > 0  # the bench lets go of each batch
  assert run["memory"]["workers"] == []
  assert report["floor"]["image_tokens_per_s"] > 0
  assert report["floor"]["parquet_bytes_read_per_byte_used"] > 0
  assert set(report["jpeg_draft"]) >= {"speedup", "mean_abs_diff", "max_abs_diff"}
  image = np.asarray(Image.open(plot_path).convert("RGB"))
  assert image.shape == (400, 640, 3)
  floor_pixels = (image == (230, 120, 20)).all(-1)  # the dashed floor line and its labels
  assert floor_pixels.sum(axis=1).max() > 300  # one row of dashes across the plot
  captured = capsys.readouterr()
  assert "x floor" in captured.out
  assert "main CPU s/row" in captured.out and "workers=0: main: RSS" in captured.out
  assert "parquet bytes read per byte used:" in captured.out
  # A line on stderr as each phase starts and each window ends: never minutes of silence.
  progress = [line.split("] ", 1)[1] for line in captured.err.splitlines() if "] " in line]
  for expected in ("0 workers: pipeline from the start of the stream; then 2 windows of 1.0 s",
                   "0 workers: window 1/2", "0 workers: window 2/2", "0 workers: restored",
                   "floor: window 2/2", "jpeg_draft: timing round 2/2", "jpeg_draft: done"):
    assert any(line.startswith(expected) for line in progress), expected


def test_convert_then_demo_on_array_record(demo_yaml, tmp_path, capsys):
  out = tmp_path / "ar"
  assert cli.main(["convert", "--config", str(demo_yaml), "--out", str(out)]) == 0
  assert cli.main(["demo", "--config", str(out / "config.yaml"), "--batches", "2"]) == 0
  assert "accounting: drawn" in capsys.readouterr().out


# -- the command line's conventions ----------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_project_version(capsys):
  version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out.strip() == f"bagel-grain {version}"


def _subcommands(parser):
  action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  return action.choices


def test_every_option_has_help_that_shows_its_default():
  parser = cli.build_parser()
  for name, sub in _subcommands(parser).items():
    text = " ".join(sub.format_help().split())
    for action in sub._actions:  # pylint: disable=protected-access
      if isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
        continue
      assert action.help, f"{name} {action.dest} has no help"
      default = action.default
      if default is None or isinstance(default, bool):
        continue
      shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
      assert f"(default: {shown})" in text, f"{name} {action.dest}"


@pytest.mark.parametrize("argv, message", [
    (["demo", "--batches", "0"], "argument --batches: must be at least 1, got 0"),
    (["demo", "--workers", "-1"], "argument --workers: must be at least 0, got -1"),
    (["bench", "--workers", "0", "-1"], "argument --workers: must be at least 0, got -1"),
    (["bench", "--seconds", "0"], "argument --seconds: must be above 0, got 0"),
    (["convert", "--config", "c.yaml", "--out", "o", "--threads", "0"],
     "argument --threads: must be at least 1, got 0"),
])
def test_out_of_range_options_are_refused_by_name(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == f"bagel-grain {argv[0]}: error: {message}"
  assert "Traceback" not in err


def test_an_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
  missing = tmp_path / "missing.yaml"
  assert cli.main(["demo", "--config", str(missing)]) == 1
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.count("\n") == 1
  assert captured.err.startswith(
      f"bagel-grain demo: error: config file not found (file '{missing}')")
  with pytest.raises(ConfigError, match="config file not found"):
    cli.main(["demo", "--config", str(missing), "--debug"])


def test_missing_demo_data_says_how_to_make_it(tmp_path, capsys):
  assert cli.main(["inspect", "--data", str(tmp_path)]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1
  assert f"no demo data in {tmp_path}; write it first with " \
      f"`bagel-grain make-sample-data {tmp_path}`" in err


def test_demo_progress_goes_to_stderr_with_its_total(demo_dir, capsys):
  assert cli.main(["demo", "--data", str(demo_dir), "--batches", "3", "--batch-size", "1",
                   "--workers", "0"]) == 0
  captured = capsys.readouterr()
  assert "3/3 [" in captured.err and "packing" in captured.err
  assert "batch/s" not in captured.out and "accounting: drawn" in captured.out


def test_convert_progress_has_a_total_per_dataset(demo_yaml, tmp_path, capsys):
  assert cli.main(["convert", "--config", str(demo_yaml), "--out", str(tmp_path / "ar")]) == 0
  captured = capsys.readouterr()
  written = {m[0]: int(m[1]) for m in re.findall(r"^(\S+): (\d+) records", captured.out, re.M)}
  assert len(written) == 3
  for name, count in written.items():  # the bar's last state: every record of its total
    assert f"{name}: 100%" in captured.err and f"{count}/{count} [" in captured.err
  assert not re.search(r": \d+record \[", captured.err)  # a count without its total
  assert "record/s" not in captured.out


def _installed_copy(site: Path) -> None:
  """What a wheel installs of the package: its modules and the declared package data."""
  package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
      "package-data"]
  for module in (ROOT / "bagel_grain").rglob("*.py"):
    target = site / module.relative_to(ROOT)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(module, target)
  for package, patterns in package_data.items():
    folder = ROOT.joinpath(*package.split("."))
    for pattern in patterns:
      for data in folder.glob(pattern):
        shutil.copy(data, site / data.relative_to(ROOT))


@pytest.mark.parametrize("install", ["source tree", "installed copy"])
def test_the_default_config_is_found_from_any_directory(install, demo_dir, tmp_path):
  site = ROOT
  if install == "installed copy":
    site = tmp_path / "site"
    _installed_copy(site)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = dict(os.environ, PYTHONPATH=str(site))
  result = subprocess.run(
      [sys.executable, "-m", "bagel_grain.tooling.cli", "demo", "--data", str(demo_dir), "--batches",
       "1", "--batch-size", "1", "--workers", "0"],
      cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  assert "accounting: drawn" in result.stdout
  where = subprocess.run([sys.executable, "-c", "import bagel_grain; print(bagel_grain.__file__)"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
  assert Path(where.stdout.strip()).is_relative_to(site)


def test_runner_without_beam_names_the_beam_venv(demo_yaml, tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "apache_beam", None)  # as in the loader's venv: no Beam
  out = tmp_path / "out"
  for argv in (["index", str(demo_yaml)],
               ["audit", "--config", str(demo_yaml), "--out", str(out / "audit")],
               ["convert", "--config", str(demo_yaml), "--out", str(out)]):
    assert cli.main([*argv, "--runner", "DirectRunner"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".venv-beam" in err and "bagel_grain[beam]" in err
  assert not out.exists()  # refused before anything was written


def test_beam_options_pass_only_with_a_runner(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["index", "c.yaml", "--direct_num_workers", "2"])
  assert exit_info.value.code == 2
  assert "unrecognized arguments: --direct_num_workers 2 (Beam's options need --runner)" in \
      capsys.readouterr().err


def test_fresh_sample_data_gives_a_quiet_demo(tmp_path):
  """`make demo` on a fresh clone: make-sample-data writes the index, the demo warns nothing."""
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  run = [sys.executable, "-m", "bagel_grain.tooling.cli"]
  made = subprocess.run([*run, "make-sample-data", str(tmp_path / "d")], env=env,
                        capture_output=True, text=True, timeout=120, check=True)
  assert "sidecar index" in made.stdout and made.stderr == ""
  assert (tmp_path / "d" / "t2i" / ".bagel_index.arrow").exists()
  demo = subprocess.run([*run, "demo", "--data", str(tmp_path / "d"), "--batches", "2",
                         "--workers", "0"], env=env, capture_output=True, text=True,
                        timeout=300, check=True)
  assert "WARNING" not in demo.stderr and "no sidecar index" not in demo.stderr


@pytest.fixture
def one_epoch_yaml(demo_yaml):
  """The demo config as a finite stream: one epoch (the demo data packs into a few dozen rows)."""
  raw = yaml.safe_load(demo_yaml.read_text())
  raw["num_epochs"] = 1
  demo_yaml.write_text(yaml.safe_dump(raw))
  return demo_yaml


def test_demo_past_the_end_of_a_finite_stream_reports_what_it_packed(one_epoch_yaml, capsys):
  assert cli.main(["demo", "--config", str(one_epoch_yaml), "--batches", "1000"]) == 0
  out = capsys.readouterr().out
  rows = int(out.split("the stream ended after ")[1].split()[0])
  assert f"the stream ended after {rows} rows (num_epochs: 1), before the 1000 batches" in out
  assert f"{rows} rows of L=" in out
  drawn = out.split("accounting: drawn ")[1].split()
  d, p, x, b, c = (int(drawn[i]) for i in (0, 3, 6, 9, 12))
  assert (d, b, c) == (p + x, 0, 0) and p + x == 76 + 30 + 60  # the epoch, all of it


def test_inspect_past_the_end_of_a_finite_stream_says_where_it_ended(one_epoch_yaml, tmp_path,
                                                                      capsys):
  assert cli.main(["inspect", "--config", str(one_epoch_yaml), "--index", "1000",
                   "--out", str(tmp_path / "row.png")]) == 1
  err = capsys.readouterr().err
  assert "error: the stream ended after " in err and "rows (num_epochs: 1), before row 1000" in err
  assert "StopIteration" not in err and not (tmp_path / "row.png").exists()
