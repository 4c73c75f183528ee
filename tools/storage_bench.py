"""Storage benchmark: start-up vs corpus size, and throughput vs object-store latency, in one run.

Part 1 (`startup`): synthetic corpora (T2I parquet shards with tiny images; a
text-only VLM JSONL), on local disk and on a local S3 server (moto) behind a
20 ms latency proxy, without and with the sidecar index (`bagel-grain index`),
for process 0 of 1 and of 64. Each case runs in a fresh process: time to first
batch, and the RSS the built pipeline holds after it (current RSS, after a
garbage collection, above the same process's RSS after imports and tokenizer).

Part 2 (`throughput`): the shipped demo config on its data (`make-sample-data`:
a VLM JSONL line and its own image objects per sample, many small objects) and
the shipped bench config on `make-bench-data` (large parquet row groups), each
on local disk and on the S3 server behind the latency proxy at 0, 50 and 150 ms
per request, with 2 workers: rows/s and image tokens/s (median of three windows, after
a warm-up long enough for the workers to start),
and the ratio to local disk; every place is measured once per round, each ratio
against local disk of the same round, and the medians over the rounds reported
(with the range of the ratios). Then the demo config on GCS (the emulator) at 50 ms
with 0 and 2 workers, 2 against 0. The local servers (moto, the emulator) and the
proxy share the machine's CPUs with the pipeline: each row says how many cores they
burned, and the load average.

    python tools/storage_bench.py --out out/storage_bench.json
    python tools/storage_bench.py --skip-startup --bench-data /tmp/bench_data
    python tools/storage_bench.py --skip-throughput --lines 10000000 --shards --local-only
    python tools/storage_bench.py --skip-startup --configs demo --workers 0 2 --rounds 1

`--table` runs only issue 28's table (first batch and steady state of the demo config,
every storage, 0 and 2 workers, each measurement a fresh process, variants in turn);
about 8 minutes on 2 cores with the defaults below:

    python tools/storage_bench.py --table --rounds 3 --warmup-s 4 --seconds 6
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test object stores (needs the test extra)
from object_store import LocalObjectStore  # pylint: disable=wrong-import-position
ROWS_PER_GROUP, GROUPS_PER_SHARD = 4, 2
_BASE = {"expected_num_tokens": 1024, "max_num_tokens": 2048, "max_num_tokens_per_sample": 1024,
         "prefer_buffer_before": 512, "max_buffer_size": 4, "max_latent_size": 32}


def _tiny_png() -> bytes:
  out = io.BytesIO()
  Image.new("RGB", (32, 32), (200, 100, 50)).save(out, "PNG")
  return out.getvalue()


def make_parquet_corpus(folder: Path, shards: int) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  png = _tiny_png()
  rows = ROWS_PER_GROUP * GROUPS_PER_SHARD
  table = pa.table({"image": [png] * rows,
                    "captions": [json.dumps({"a": f"caption {i}"}) for i in range(rows)]})
  for s in range(shards):
    pq.write_table(table, folder / f"part-{s:05d}.parquet", row_group_size=ROWS_PER_GROUP)


def make_jsonl_corpus(path: Path, lines: int) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  line = ('{"conversations": [{"from": "human", "value": "What is %07d plus one?"}, '
          '{"from": "gpt", "value": "The next number."}]}\n')
  with open(path, "w") as f:
    for start in range(0, lines, 100_000):
      f.write("".join(line % i for i in range(start, min(lines, start + 100_000))))


def _config(root: str, tokenizer: str, family: str) -> dict:
  if family == "t2i_pretrain":
    info = {"t2i_pretrain": {"synthetic": {"data_dir": f"{root}/t2i"}}}
    group = {"dataset_names": ["synthetic"], "weight": 1, "is_mandatory": True,
             "image_transform_args": {"image_stride": 16, "max_image_size": 64,
                                      "min_image_size": 32}}
  else:
    info = {"vlm_sft": {"synthetic": {"data_dir": f"{root}/vlm",
                                      "jsonl_path": f"{root}/vlm/sft.jsonl"}}}
    group = {"dataset_names": ["synthetic"], "weight": 1, "is_mandatory": True,
             "shuffle_lines": True, "shuffle_seed": 0,
             "image_transform_args": {"image_stride": 14, "max_image_size": 224,
                                      "min_image_size": 56}}
  return {**_BASE, "tokenizer_path": tokenizer, "dataset_info": info,
          "grouped_datasets": {family: group}}


def measure_one(config_path: str, process_index: int, process_count: int) -> dict:
  """In this (fresh) process: time to first batch and RSS above the post-import baseline."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.config import load_config
  from bagel_grain.pipeline import build_pipeline
  from bagel_grain.tokenizer import load_tokenizer
  cfg = load_config(config_path)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  me = psutil.Process()
  gc.collect()
  baseline = me.memory_info().rss
  start = time.perf_counter()
  dataset = build_pipeline(cfg, tokenizer, batch_size=1, process_index=process_index,
                           process_count=process_count, workers=0)
  it = iter(dataset)
  built = time.perf_counter() - start  # the index loaded; then the first batch's reads
  next(it)
  first = time.perf_counter() - start
  gc.collect()
  held = me.memory_info().rss  # what the built pipeline holds, not a transient peak
  records = _shuffled_records(dataset)
  index_bytes = sum(_array_bytes(r, set()) for r in records)
  # Blocks of this process's share: row groups, or lines (blocks of one line).
  units = sum(r.blocks_per_epoch for r in records)
  it.close()
  return {"build_s": built, "first_batch_s": first, "rss_above_baseline_mib": (held - baseline) / 2**20,
          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
          "index_bytes": index_bytes, "share_units": units,
          "index_bytes_per_unit": index_bytes / max(units, 1)}


def _shuffled_records(dataset) -> list:
  """The ShuffledRecords a pipeline's dataset reads (found through its parents)."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.sources.records import ShuffledRecords
  found, todo, seen = [], [dataset], set()
  while todo:
    d = todo.pop()
    if id(d) in seen:
      continue
    seen.add(id(d))
    if isinstance(d, ShuffledRecords):
      found.append(d)
    todo.extend(d.parents)
  return found


def _array_bytes(obj, seen: set) -> int:
  """Bytes of the numpy arrays an object of ours holds (its per-unit index), recursively."""
  if id(obj) in seen:
    return 0
  seen.add(id(obj))
  if isinstance(obj, np.ndarray):
    return obj.nbytes
  if isinstance(obj, (list, tuple)):
    return sum(_array_bytes(v, seen) for v in obj)
  if isinstance(obj, dict):
    return sum(_array_bytes(v, seen) for v in obj.values())
  if type(obj).__module__.startswith("bagel_grain.sources") and hasattr(obj, "__dict__"):
    return sum(_array_bytes(v, seen) for v in vars(obj).values())
  return 0


def _measure(config: dict, process_index: int, process_count: int, env: dict) -> dict:
  with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    yaml.safe_dump(config, f)
  try:
    out = subprocess.run([sys.executable, __file__, "_measure", f.name, str(process_index),
                          str(process_count)], capture_output=True, text=True, check=True,
                         env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
  finally:
    os.unlink(f.name)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _index(config: dict, env: dict) -> float:
  with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    yaml.safe_dump(config, f)
  start = time.perf_counter()
  try:
    subprocess.run([sys.executable, "-m", "bagel_grain.tooling.cli", "index", f.name], check=True,
                   capture_output=True, env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
  finally:
    os.unlink(f.name)
  return time.perf_counter() - start


def startup(work: Path, shards: list[int], lines: list[int], delay_ms: float,
            local_only: bool = False) -> list[dict]:
  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling.demo_data import write_tokenizer
  tokenizer = work / "tokenizer"
  write_tokenizer(tokenizer)
  corpora = [("t2i_pretrain", "shards", n) for n in shards] + [
      ("vlm_sft", "lines", n) for n in lines]
  results = []
  with LocalObjectStore("s3") as store:
    remote_env = store.environment(store.proxy_port(delay_ms))
    for family, unit, n in corpora:
      local = work / f"{unit}_{n}"
      t0 = time.perf_counter()
      if family == "t2i_pretrain":
        make_parquet_corpus(local / "t2i", n)
      else:
        make_jsonl_corpus(local / "vlm" / "sft.jsonl", n)
      made = time.perf_counter() - t0
      places = [("local disk", str(local), {}, str(tokenizer))]
      if not local_only:
        store.upload(str(local), f"{unit}_{n}")
        places.append((f"S3 at {delay_ms:g} ms", store.uri(f"{unit}_{n}"), remote_env,
                       str(tokenizer)))
      for where, root, env, tok in places:
        config = _config(root, tok, family)
        for indexed in (False, True):
          index_s = _index(config, env) if indexed else None
          for count in (1, 64):
            r = _measure(config, 0, count, env)
            r.update(corpus=f"{n:,} {unit}", storage=where, index=indexed, process_count=count,
                     index_build_s=index_s, generate_s=made)
            per = n * GROUPS_PER_SHARD if unit == "shards" else n  # row groups, or lines
            r["bytes_per_unit"] = r["rss_above_baseline_mib"] * 2**20 / per
            print(json.dumps(r), flush=True)
            results.append(r)
  return results


def _on(root: str, data: Path, shipped: str, tokenizer: Path) -> dict:
  """The shipped config `shipped` (demo or bench) with every data path under `root`."""
  from bagel_grain.configs import shipped_path  # pylint: disable=import-outside-toplevel
  raw = yaml.safe_load(shipped_path(shipped).read_text())
  info = yaml.safe_load((data / "dataset_info.yaml").read_text())
  for datasets in info.values():
    for entry in datasets.values():
      for key in ("data_dir", "jsonl_path", "parquet_info_path"):
        if key in entry:
          entry[key] = f"{root}/{entry[key]}"
  return {**raw, "dataset_info": info, "tokenizer_path": str(tokenizer)}


def throughput(work: Path, data: Path | None, seconds: float, delays: list[float],
               workers: list[int], rounds: int = 3, gcs_delay: float | None = 50,
               warmup_s: float = 10, configs: tuple[str, ...] = ("demo", "bench")) -> list[dict]:
  """Rows/s and image tokens/s of the shipped demo config (a VLM JSONL line and its own
  image objects per sample: many small objects) and of the bench config (large parquet
  row groups), on local disk and on S3 behind the latency proxy, in one run; and the
  demo config on GCS (the emulator) behind the proxy at `gcs_delay` ms with 0 and 2
  workers. Each row also says how busy the machine was (load average) and how much CPU
  the server and proxy burned on the same cores (cores = CPU seconds per second)."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling.bench_data import make_bench_data
  from bagel_grain.tooling.demo_data import make_sample_data
  from bagel_grain.config import load_config
  from bagel_grain.tokenizer import load_tokenizer
  if "bench" in configs and (data is None or not (data / ".complete").exists()):
    data = make_bench_data(data or work / "bench_data", t2i_rows=256, edit_rows=64, vlm_rows=200)
  demo = make_sample_data(work / "demo_data")
  corpora = [c for c in [("demo", demo, demo / "tokenizer"), ("bench", data, data and
                                                              data / "tokenizer")]
             if c[0] in configs]
  results = []

  def run(config_name: str, corpus: Path, tokenizer_dir: Path, where: str, root: str,
          env: dict, worker_counts: list[int], servers: list[psutil.Process], round_: int):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
      yaml.safe_dump(_on(root, corpus, config_name, tokenizer_dir), f)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
      cfg = load_config(f.name)
      tokenizer = load_tokenizer(cfg.tokenizer_path)
      for w in worker_counts:
        load, cpu, t0 = os.getloadavg()[0], _cpu_seconds(servers), time.perf_counter()
        r = _windows(cfg, tokenizer, w, warmup_s, seconds)
        wall = time.perf_counter() - t0
        row = {"config": config_name, "storage": where, "workers": w, "round": round_, **r,
               "server_cores": (_cpu_seconds(servers) - cpu) / wall if servers else None,
               "load": max(load, os.getloadavg()[0])}
        print(json.dumps(row), flush=True)
        results.append(row)
    finally:
      os.unlink(f.name)
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v

  with LocalObjectStore("s3") as store, LocalObjectStore("gcs") as gcs:
    roots = {name: store.upload(str(corpus), name) for name, corpus, _ in corpora}
    s3_servers = _processes(store)
    places = [("local disk", None, {})] + [
        (f"S3 at {delay:g} ms", "s3", store.environment(store.proxy_port(delay) if delay else None))
        for delay in delays]
    gcs_root = gcs.upload(str(demo), "demo") if gcs_delay is not None else None
    gcs_env = gcs.environment(gcs.proxy_port(gcs_delay) if gcs_delay else None)
    # Rounds of every place one after the other: on a shared machine the load drifts,
    # and a ratio to local disk measured minutes apart would mostly measure the drift.
    for round_ in range(rounds):
      for name, corpus, tokenizer_dir in corpora:
        for where, remote, env in places:
          run(name, corpus, tokenizer_dir, where, roots[name] if remote else str(corpus), env,
              workers, s3_servers if remote else [], round_)
      if gcs_root is not None:
        run("demo", demo, demo / "tokenizer", f"GCS at {gcs_delay:g} ms", gcs_root, gcs_env,
            sorted(set(workers) | {0, 2}), _processes(gcs), round_)
  for r in results:
    local = next((x for x in results if x["storage"] == "local disk"
                  and x["config"] == r["config"] and x["workers"] == r["workers"]
                  and x["round"] == r["round"]), None)
    if local is not None:
      r["ratio_to_local"] = r["rows_per_s"] / local["rows_per_s"]
    # Against the server without added latency: what latency costs, apart from the
    # server's own CPU (moto serves each request in Python, on the same cores).
    server = next((x for x in results if x["storage"] == "S3 at 0 ms"
                   and x["config"] == r["config"] and x["workers"] == r["workers"]
                   and x["round"] == r["round"]), None)
    if server is not None and r["storage"].startswith("S3"):
      r["ratio_to_s3_0ms"] = r["rows_per_s"] / server["rows_per_s"]
    if r["storage"].startswith("GCS"):  # the goal: 2 workers no slower than 0
      none = next(x for x in results if x["storage"] == r["storage"] and x["workers"] == 0
                  and x["round"] == r["round"])
      r["ratio_to_0_workers"] = r["rows_per_s"] / none["rows_per_s"]
  summary = []
  for key in dict.fromkeys((r["config"], r["storage"], r["workers"]) for r in results):
    same = [r for r in results if (r["config"], r["storage"], r["workers"]) == key]
    ratio = "ratio_to_0_workers" if "ratio_to_0_workers" in same[0] else "ratio_to_local"
    summary.append({"config": key[0], "storage": key[1], "workers": key[2], "rounds": len(same),
                    **{f: statistics.median(r[f] for r in same)
                       for f in ("rows_per_s", "image_tokens_per_s", "first_batch_s", "load")},
                    **{f: statistics.median(r[f] for r in same)
                       for f in ("ratio_to_local", "ratio_to_s3_0ms", "ratio_to_0_workers",
                                 "server_cores") if same[0].get(f) is not None},
                    "ratio_range": (f"{min(r[ratio] for r in same):.2f}-"
                                    f"{max(r[ratio] for r in same):.2f}")})
  return summary


def _windows(cfg, tokenizer, workers: int, warmup_s: float, seconds: float) -> dict:
  """Rows/s and image tokens/s, medians of three windows, after `warmup_s` of batches: the
  workers started and every place warm (a window while workers start would measure the
  main process alone, and flatter nothing but the place with the quickest first batch)."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  start = time.perf_counter()
  it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=workers))
  try:
    next(it)
    first_batch_s = time.perf_counter() - start
    while time.perf_counter() - start < warmup_s:
      next(it)
    rows, tokens = [], []
    for _ in range(3):
      before, t0 = pipeline_stats(it), time.perf_counter()
      while time.perf_counter() - t0 < seconds / 3:
        next(it)
      after, took = pipeline_stats(it), time.perf_counter() - t0
      rows.append((after["rows"] - before["rows"]) / took)
      tokens.append((after["image_tokens"] - before["image_tokens"]) / took)
  finally:
    it.close()
  return {"rows_per_s": statistics.median(rows), "image_tokens_per_s": statistics.median(tokens),
          "first_batch_s": first_batch_s}


def table(work: Path, tries: int, warmup_s: float, seconds: float) -> list[dict]:
  """Issue 28's table in one run: the demo config on local disk, on S3 at 0, 50 and 150 ms
  and on GCS at 50 ms, with 0 and 2 workers: first batch and steady state. Each
  measurement is a fresh process (no connection, cache or import left warm by another);
  the variants take turns, `tries` times, and the medians are reported with, per try,
  the ratio to local disk of the same try and worker count."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.tooling.demo_data import make_sample_data
  demo = make_sample_data(work / "demo_data")
  rows = []
  with LocalObjectStore("s3") as s3, LocalObjectStore("gcs") as gcs:
    places = [("local disk", str(demo), {}, [])]
    s3_root, gcs_root = s3.upload(str(demo), "demo"), gcs.upload(str(demo), "demo")
    for delay in (0, 50, 150):
      places.append((f"S3 at {delay} ms", s3_root,
                     s3.environment(s3.proxy_port(delay) if delay else None), _processes(s3)))
    places.append(("GCS at 50 ms", gcs_root, gcs.environment(gcs.proxy_port(50)),
                   _processes(gcs)))
    configs = {}
    for where, root, _, _ in places:
      with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, dir=work) as f:
        yaml.safe_dump(_on(root, demo, "demo", demo / "tokenizer"), f)
      configs[where] = f.name
    for try_ in range(tries):
      for workers in (0, 2):
        for where, _, env, servers in places:
          load, cpu, t0 = os.getloadavg()[0], _cpu_seconds(servers), time.perf_counter()
          out = subprocess.run([sys.executable, __file__, "_place", configs[where], str(workers),
                                str(warmup_s), str(seconds)], capture_output=True, text=True,
                               check=True, timeout=600,
                               env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
          r = json.loads(out.stdout.strip().splitlines()[-1])
          wall = time.perf_counter() - t0
          row = {"storage": where, "workers": workers, "try": try_, **r,
                 "server_cores": (_cpu_seconds(servers) - cpu) / wall if servers else None,
                 "load": max(load, os.getloadavg()[0])}
          print(json.dumps(row), flush=True)
          rows.append(row)
  for r in rows:
    local = next(x for x in rows if x["storage"] == "local disk"
                 and x["workers"] == r["workers"] and x["try"] == r["try"])
    r["first_x_local"] = r["first_batch_s"] / local["first_batch_s"]
    r["steady_x_local"] = r["rows_per_s"] / local["rows_per_s"]
  summary = []
  for key in dict.fromkeys((r["storage"], r["workers"]) for r in rows):
    same = [r for r in rows if (r["storage"], r["workers"]) == key]
    summary.append({"storage": key[0], "workers": key[1], "tries": len(same),
                    **{f: statistics.median(r[f] for r in same) for f in (
                        "start_s", "first_batch_s", "first_x_local", "rows_per_s",
                        "steady_x_local", "load")},
                    "first_x_range": (f"{min(r['first_x_local'] for r in same):.2f}-"
                                      f"{max(r['first_x_local'] for r in same):.2f}")})
  return summary


def _place(config_path: str, workers: int, warmup_s: float, seconds: float) -> dict:
  """In this (fresh) process: the config and tokenizer loaded (`start_s`: the config's
  checks of its paths and the tokenizer's files, on a bucket a few round trips), then
  `_windows`: the first batch timed from the `build_pipeline` call to the first batch
  in hand, the same instant on every storage, then the steady state."""
  # pylint: disable=import-outside-toplevel
  from bagel_grain.config import load_config
  from bagel_grain.tokenizer import load_tokenizer
  t0 = time.perf_counter()
  cfg = load_config(config_path)
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  start_s = time.perf_counter() - t0
  return {"start_s": start_s, **_windows(cfg, tokenizer, workers, warmup_s, seconds)}


def _processes(store: LocalObjectStore) -> list[psutil.Process]:
  """The server and proxy processes of a test object store (their CPU is the harness's)."""
  return [p for p in psutil.Process().children() if p.pid in store.pids()]


def _cpu_seconds(processes: list[psutil.Process]) -> float:
  total = 0.0
  for p in processes:
    try:
      times = p.cpu_times()
    except psutil.Error:
      continue
    total += times.user + times.system
  return total


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
  head = "| " + " | ".join(c[1] for c in columns) + " |"
  lines = [head, "|" + "---|" * len(columns)]
  for r in rows:
    cells = []
    for key, _, fmt in columns:
      v = r.get(key)
      cells.append("-" if v is None else format(v, fmt) if fmt else str(v))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "_measure":
    print(json.dumps(measure_one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    return
  if len(sys.argv) > 1 and sys.argv[1] == "_place":
    print(json.dumps(_place(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                            float(sys.argv[5]))), flush=True)
    return
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shards", type=int, nargs="*", default=[100, 1000, 5000])
  parser.add_argument("--lines", type=int, nargs="*", default=[1_000_000, 10_000_000])
  parser.add_argument("--startup-delay-ms", type=float, default=20)
  parser.add_argument("--delays-ms", type=float, nargs="*", default=[0, 50, 150])
  parser.add_argument("--workers", type=int, nargs="*", default=[2])
  parser.add_argument("--gcs-delay-ms", type=float, default=50,
                      help="throughput: the demo config on GCS at this latency, 0 and 2 workers "
                           "(negative: skipped)")
  parser.add_argument("--seconds", type=float, default=12)
  parser.add_argument("--warmup-s", type=float, default=10,
                      help="throughput: batches taken before the windows (workers started)")
  parser.add_argument("--rounds", type=int, default=3,
                      help="throughput: every place measured once per round; medians reported")
  parser.add_argument("--bench-data", type=Path, default=None,
                      help="`bagel-grain make-bench-data` output to use (written there if absent)")
  parser.add_argument("--table", action="store_true",
                      help="only issue 28's table (demo config; local disk, S3 at 0/50/150 ms, "
                           "GCS at 50 ms; 0 and 2 workers; first batch and steady state), "
                           "`--rounds` tries, each measurement a fresh process")
  parser.add_argument("--skip-startup", action="store_true")
  parser.add_argument("--local-only", action="store_true",
                      help="start-up on local disk only (moto copies a whole object per "
                           "range request: a 1 GB JSONL costs about 1 s a line there)")
  parser.add_argument("--skip-throughput", action="store_true")
  parser.add_argument("--configs", nargs="*", default=["demo", "bench"],
                      choices=["demo", "bench"], help="throughput: the shipped configs to run")
  parser.add_argument("--out", default="out/storage_bench.json")
  args = parser.parse_args()
  report = {}
  with tempfile.TemporaryDirectory(prefix="bagel-storage-bench-") as tmp:
    if args.table:
      report["table"] = table(Path(tmp), args.rounds, args.warmup_s, args.seconds)
      print(_table(report["table"], [
          ("storage", "storage", ""), ("workers", "workers", ""),
          ("first_batch_s", "first batch s", ".2f"), ("first_x_local", "x local", ".2f"),
          ("first_x_range", "range", ""), ("rows_per_s", "steady rows/s", ".2f"),
          ("steady_x_local", "x local", ".2f"), ("start_s", "config+tokenizer s", ".2f"),
          ("load", "load avg", ".1f")]))
      args.skip_startup = args.skip_throughput = True
    if not args.skip_startup:
      report["startup"] = startup(Path(tmp), args.shards, args.lines, args.startup_delay_ms,
                                  args.local_only)
      print(_table(report["startup"], [
          ("corpus", "corpus", ""), ("storage", "storage", ""), ("index", "index", ""),
          ("process_count", "processes", ""), ("build_s", "build s", ".2f"),
          ("first_batch_s", "first batch s", ".2f"),
          ("rss_above_baseline_mib", "RSS held MiB", ".1f"),
          ("index_bytes_per_unit", "index B/unit", ".1f"), ("index_build_s", "index build s",
                                                          ".1f")]))
    if not args.skip_throughput:
      bench_data = args.bench_data and args.bench_data.resolve()  # configs live in tmp
      report["throughput"] = throughput(Path(tmp), bench_data, args.seconds,
                                        args.delays_ms, args.workers, args.rounds,
                                        args.gcs_delay_ms if args.gcs_delay_ms >= 0 else None,
                                        args.warmup_s, tuple(args.configs))
      print(_table(report["throughput"], [
          ("config", "config", ""), ("storage", "storage", ""), ("workers", "workers", ""),
          ("rows_per_s", "rows/s", ".2f"), ("image_tokens_per_s", "image tokens/s", ",.0f"),
          ("ratio_to_local", "x local", ".2f"), ("ratio_to_0_workers", "x 0 workers", ".2f"),
          ("ratio_range", "range", ""), ("ratio_to_s3_0ms", "x S3 at 0 ms", ".2f"),
          ("server_cores", "server+proxy cores", ".2f"), ("load", "load avg", ".1f"),
          ("first_batch_s", "first batch s", ".2f")]))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
