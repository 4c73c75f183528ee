"""`bagel-grain convert --runner`: the loader venv's in-process shards, byte for byte, whatever
the runner, the worker count, a retried bundle or the storage."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bagel_grain import fs
from bagel_grain.tooling import beam_convert
from beam_helpers import MULTI, beam_cli, demo_copy, tree_bytes


@pytest.fixture(scope="module")
def in_process(demo_dir, tmp_path_factory, loader_cli):
  """(config, {path: bytes} of what the loader venv's `bagel-grain convert` writes)."""
  tmp = tmp_path_factory.mktemp("convert")
  config = demo_copy(demo_dir, tmp)
  loader_cli("convert", "--config", str(config), "--out", str(tmp / "in_process"),
             "--records-per-shard", "16")
  written = tree_bytes(tmp / "in_process")
  assert sum(name.endswith(".array_record") for name in written) == 8 + 2 + 4  # 116, 24, 50
  return config, written


def test_two_workers_write_the_same_files(in_process, tmp_path):
  config, expected = in_process
  out = beam_cli("convert", "--config", str(config), "--out", str(tmp_path / "beam"),
                 "--records-per-shard", "16", "--runner", "DirectRunner", *MULTI)
  assert "vlm_sft/demo_vlm: 50 records in 4 ArrayRecord files" in out
  written = tree_bytes(tmp_path / "beam")
  assert written.keys() == expected.keys()
  assert all(written[name] == expected[name] for name in expected)


def test_a_bundle_failing_on_its_first_attempt_is_retried_without_duplicates(in_process,
                                                                               tmp_path):
  config, expected = in_process
  marker = tmp_path / "failed-once"
  # The bundle-based DirectRunner retries a failed bundle, as a cluster runner does.
  beam_convert.run_convert(str(config), tmp_path / "out", "BundleBasedDirectRunner",
                           records_per_shard=16, fail_first=str(marker))
  failed_at = marker.read_text()  # the first attempt wrote half a shard, then failed
  assert failed_at.endswith(".array_record")
  written = tree_bytes(tmp_path / "out")
  assert written.keys() == expected.keys()  # no partial file left behind
  assert all(written[name] == expected[name] for name in expected)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_shards_are_uploaded_to_a_bucket(in_process, kind, monkeypatch):
  from object_store import LocalObjectStore  # the tests' local S3 and GCS servers
  config, expected = in_process
  with LocalObjectStore(kind) as store:
    for name, value in store.environment().items():
      monkeypatch.setenv(name, value)
    out = store.uri("converted")
    done = beam_convert.run_convert(str(config), out, "DirectRunner", records_per_shard=16)
    assert done.config == f"{out}/config.yaml"
    for name, data in expected.items():
      assert fs.read_bytes(f"{out}/{name}") == data, name
    with pytest.raises(Exception, match="does not write.*overwrite"):  # another plan's
      beam_convert.run_convert(str(config), out, "DirectRunner", records_per_shard=20)


# Killed mid-shard (after 20 records: in the second shard written) and between shards (after 5
# whole shards); then the same command.
@pytest.mark.parametrize("where,n", [("record", 20), ("shard", 5)])
def test_a_killed_runner_resumes_to_the_loader_venvs_bytes(in_process, tmp_path, where, n):
  config, expected = in_process
  out = tmp_path / "out"
  killer = Path(__file__).resolve().parents[1] / "killed_convert.py"
  done = subprocess.run([sys.executable, str(killer), str(config), str(out), where, str(n),
                         "DirectRunner"], capture_output=True, text=True, timeout=300,
                        check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
  finished = {p: p.stat().st_mtime_ns for p in out.rglob("*.array_record")}
  assert len(finished) == (1 if where == "record" else n)
  assert not (out / "config.yaml").exists()
  assert any(".partial-" in p.name for p in out.rglob("*")) == (where == "record")
  beam_convert.run_convert(str(config), out, "DirectRunner", records_per_shard=16)
  assert tree_bytes(out) == expected  # no partial file either
  assert all(p.stat().st_mtime_ns == t for p, t in finished.items())  # kept, not rewritten
