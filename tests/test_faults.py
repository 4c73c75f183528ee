"""Faults while the stream runs: a worker killed, files damaged mid-run, closing, a soak run.

Every wait here is under a deadline (signal.alarm, or a child process with a
timeout), so a hang fails the test instead of stalling CI.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from bagel_grain.config import config_from_dict
from bagel_grain.errors import GroupExhaustedError
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from deadline import deadline

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "bagel_grain" / "configs"


# The worker-pool tests run in a child process: a hang or a leaked worker there cannot
# hang this pytest session; the child reports what it saw, then leaves with os._exit.
CHILD_PRELUDE = textwrap.dedent("""
    import contextlib, json, os, signal, sys, time
    import psutil, yaml
    from bagel_grain.config import config_from_dict
    from bagel_grain.pipeline import build_pipeline
    from bagel_grain.tokenizer import load_tokenizer

    @contextlib.contextmanager
    def deadline(seconds, step):
      def expired(signum, frame):
        raise TimeoutError(f"{step}: still running after {seconds} s")
      signal.signal(signal.SIGALRM, expired)
      signal.alarm(seconds)
      try:
        yield
      finally:
        signal.alarm(0)

    def pool_workers(expected=2, timeout=20.0):
      # the pool's workers, not multiprocessing's resource tracker
      stop = time.monotonic() + timeout
      while True:
        out = []
        for p in psutil.Process().children(recursive=True):
          try:
            if "resource_tracker" not in " ".join(p.cmdline()) and p.status() != "zombie":
              out.append(p)
          except psutil.Error:
            pass
        if len(out) >= expected or time.monotonic() > stop:
          return out
        time.sleep(0.05)

    def alive(processes, timeout=5.0):
      _, left = psutil.wait_procs(processes, timeout=timeout)
      return [p.pid for p in left if p.is_running() and p.status() != "zombie"]

    def report(out):
      print(json.dumps(out), flush=True)
      sys.stderr.flush()
      os._exit(0)  # skip interpreter shutdown: it joins leaked workers forever

    demo, configs = sys.argv[1], sys.argv[2]
    raw = yaml.safe_load(open(configs + "/demo.yaml"))
    raw.update(dataset_info=demo + "/dataset_info.yaml", tokenizer_path=demo + "/tokenizer")
    cfg = config_from_dict(raw, file="demo.yaml", base_dir=configs)
    tokenizer = load_tokenizer(demo + "/tokenizer/tokenizer.json")
""")

KILL_CHILD = CHILD_PRELUDE + textwrap.dedent("""
    from bagel_grain.workers import WorkerError
    out = {}
    try:
      with deadline(60, "start"):
        it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=2))
        next(it)
        next(it)
        workers = pool_workers()
      out["workers"] = [p.pid for p in workers]
      os.kill(workers[0].pid, signal.SIGKILL)
      start = time.monotonic()
      try:
        with deadline(30, "error after the kill"):
          while True:
            next(it)
      except WorkerError as e:
        out["error"], out["error_s"] = "WorkerError", time.monotonic() - start
      try:
        with deadline(10, "next after the error"):
          next(it)
        out["after_error"] = "a batch"
      except WorkerError:
        out["after_error"] = "WorkerError"
      start = time.monotonic()
      with deadline(10, "close"):
        it.close()
      out["close_s"] = time.monotonic() - start
      out["alive"] = alive(workers)
    except BaseException as e:
      out["failure"] = f"{type(e).__name__}: {e}"
    report(out)
""")

CLOSE_CHILD = CHILD_PRELUDE + textwrap.dedent("""
    out = {}
    try:
      with deadline(60, "run"):
        it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=2))
        for _ in range(3):
          next(it)
        workers = pool_workers()
      out["workers"] = [p.pid for p in workers]
      start = time.monotonic()
      with deadline(10, "close"):
        it.close()
      out["close_s"] = time.monotonic() - start
      out["alive"] = alive(workers)
      out["left"] = [p.pid for p in pool_workers(expected=0, timeout=0)]
    except BaseException as e:
      out["failure"] = f"{type(e).__name__}: {e}"
    report(out)
""")


def run_child(script: str, demo_dir: Path, timeout: float = 120) -> tuple[dict, str]:
  """Runs a child script; whatever it leaves running is killed (by pid) before asserting."""
  child = subprocess.Popen([sys.executable, "-c", script, str(demo_dir), str(CONFIGS)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  descendants = []
  try:
    stdout, stderr = child.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    with contextlib.suppress(psutil.Error):
      descendants = psutil.Process(child.pid).children(recursive=True)
    child.kill()
    stdout, stderr = child.communicate()
    stdout += '\n{"failure": "the child process hung"}'
  lines = [line for line in stdout.splitlines() if line.startswith("{")]
  out = json.loads(lines[-1]) if lines else {"failure": "no report", "stderr": stderr[-2000:]}
  leftovers = descendants + [psutil.Process(pid) for pid in out.get("workers", [])
                             if psutil.pid_exists(pid)]
  out["orphans"] = []
  for p in leftovers:
    with contextlib.suppress(psutil.Error):
      if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
        out["orphans"].append(p.pid)
        p.kill()
  return out, stderr


@pytest.fixture(scope="module")
def worker_kill(demo_dir):
  """What a child saw after SIGKILL of one of its two workers (see KILL_CHILD)."""
  return run_child(KILL_CHILD, demo_dir)


def test_killed_worker_surfaces_as_worker_error(worker_kill):
  out, stderr = worker_kill
  assert out.get("error") == "WorkerError" and out["error_s"] < 30, (out, stderr[-3000:])


def test_after_a_killed_worker_the_stream_stays_failed_and_no_process_is_left(worker_kill):
  out, stderr = worker_kill
  assert "failure" not in out, (out, stderr[-3000:])
  assert out["after_error"] == "WorkerError", out  # not a batch with the failed element skipped
  assert out["close_s"] < 5 and out["alive"] == [] and out["orphans"] == [], out


def test_close_releases_workers_without_leak_warnings(demo_dir):
  out, stderr = run_child(CLOSE_CHILD, demo_dir)
  assert "failure" not in out, (out, stderr[-3000:])
  assert len(out["workers"]) == 2 and out["alive"] == out["left"] == out["orphans"] == []
  assert out["close_s"] < 5
  for marker in ("leaked", "resource_tracker", "Traceback", "Exception ignored", "Warning"):
    assert marker not in stderr, stderr


def _t2i_copy_config(demo_dir: Path, tmp_path: Path):
  shutil.copytree(demo_dir / "t2i", tmp_path / "t2i")
  info = yaml.safe_load((demo_dir / "dataset_info.yaml").read_text())
  info["t2i_pretrain"]["demo_t2i"]["data_dir"] = str(tmp_path / "t2i")
  for group in ("unified_edit", "vlm_sft"):
    for spec in info[group].values():
      for key in ("data_dir", "jsonl_path", "parquet_info_path"):
        if key in spec:
          spec[key] = str(demo_dir / spec[key])
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw.update(dataset_info=info, tokenizer_path=str(demo_dir / "tokenizer"), num_epochs=1)
  return config_from_dict(raw, file="demo.yaml", base_dir=str(CONFIGS))


@pytest.mark.parametrize("damage", ["garbage", "deleted", "rewritten_shorter"])
def test_parquet_shard_unreadable_mid_run_is_counted_not_fatal(demo_dir, demo_tokenizer,
                                                               tmp_path, damage):
  cfg = dataclasses.replace(_t2i_copy_config(demo_dir, tmp_path), max_row_group_cache_bytes=0)
  shard = tmp_path / "t2i" / "part-00000.parquet"
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0))
  packed = []
  with deadline(60):
    first = next(it)
    if damage == "garbage":
      shard.write_bytes(b"not a parquet file any more " * 100)
    elif damage == "deleted":
      shard.unlink()
    else:  # 2 rows where 40 were indexed: the rows no longer there are dropped
      pq.write_table(pq.read_table(shard).slice(0, 2), shard)
    batches = [first] + list(it)
  stats = pipeline_stats(it)
  it.close()
  for batch in batches:
    packed += [record for keys in batch["sample_keys"] for g, _, _, record in keys
               if g == "t2i_pretrain"]
  drops = stats["drops"]["t2i_pretrain"]
  assert drops and all(reason.startswith("unreadable_file") for reason in drops)
  from_shard = sum(1 for record in packed if "part-00000.parquet#" in record)
  assert from_shard + sum(drops.values()) == 40  # the damaged shard's rows: packed or counted
  assert len(packed) - from_shard == 36  # the other shard is untouched
  assert stats["counts"]["t2i_pretrain"]["drawn"] == 76
  assert stats["drawn"] == stats["packed"] + stats["dropped"]  # the epoch ran to its end


def test_soak_smoke(demo_dir, tmp_path):
  summary_path = tmp_path / "summary.json"
  child = subprocess.run(
      [sys.executable, str(ROOT / "tools" / "soak.py"), "--seconds", "6", "--workers", "2",
       "--report-every", "2", "--data", str(demo_dir), "--json", str(summary_path),
       "--anon-tolerance-mib", "4096"],  # halves of 3 s: start-up, not a leak
      capture_output=True, text=True, timeout=120)
  assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
  summary = json.loads(summary_path.read_text())
  assert summary["balanced"] and summary["error"] is None and summary["rows"] > 0
  assert summary["counters"]["dropped"] > 0 and summary["workers_left_after_close"] == []
  memory = summary["memory"]["processes"]
  assert len(memory) == 3 and all(p["first_half"]["RssAnon_peak"] > 0 for p in memory.values())
  assert child.stdout.count("balanced") >= 2  # periodic reports
  assert "NOT BALANCED" not in child.stdout


@pytest.mark.parametrize("workers", [0, 2])
def test_a_jsonl_deleted_mid_run_stops_its_group_whatever_the_worker_count(
    demo_dir, demo_tokenizer, tmp_path, workers):
  shutil.copytree(demo_dir / "vlm", tmp_path / "vlm")
  info = yaml.safe_load((demo_dir / "dataset_info.yaml").read_text())
  for group in info.values():
    for spec in group.values():
      for key in ("data_dir", "jsonl_path", "parquet_info_path"):
        if key in spec:
          spec[key] = str((tmp_path if group is info["vlm_sft"] else demo_dir) / spec[key])
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw.update(dataset_info=info, tokenizer_path=str(demo_dir / "tokenizer"), num_epochs=None)
  cfg = config_from_dict(raw, file="demo.yaml", base_dir=str(CONFIGS))
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=workers))
  try:
    with deadline(120):
      next(it)  # the main process (0 workers) holds the file open from here
      (tmp_path / "vlm" / "sft.jsonl").unlink()
      with pytest.raises(GroupExhaustedError, match=r"group 'vlm_sft'.*unreadable_file.*"
                         r"sft\.jsonl"):
        for _ in range(1000):
          next(it)
  finally:
    it.close()
