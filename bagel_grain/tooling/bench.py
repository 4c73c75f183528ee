"""`bagel-grain bench`: throughput against the decode+resize floor, measured in one run.

For each worker count the pipeline runs from the start of the stream: a warm-up,
then `windows` timed windows. Image tokens count the decode work of the samples
drawn (tokens of each distinct resized image, buffered samples included). The floor is measured
in the same run on the same records: the samples of the single-threaded run's
windows are re-made by their family transforms alone (records read beforehand,
a no-op tokenizer, no layout, no packing), single-threaded. Every throughput
figure is reported beside its ratio to that floor.

The main process's cost per row is its CPU seconds (all its threads, the bench's
own bookkeeping included) over the rows of the timed windows; the host throughput
it implies, 1 / that, is the rows/s at which the main process alone would be
saturated. The memory split is read at the end of the timed windows, per process
(`memory_split`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import grain
import numpy as np
import psutil

from bagel_grain import held_memory
from bagel_grain.config import PipelineConfig
from bagel_grain.ledger import Ledger, step_rows
from bagel_grain.pipeline import (build_pipeline, family_transform, group_seed, group_source,
                                  pipeline_stats)
from bagel_grain.packing.prepare import resized_image_tokens
from bagel_grain.packing.stage import with_stage_timing
from bagel_grain.sample import Sample
from bagel_grain.sources.parquet import ParquetRowSource
from bagel_grain.sources.records import ShuffledRecords
from bagel_grain.workers import fetcher


JPEG_DRAFT_SAMPLES = 300


class _RssSampler:
  """Peak RSS of this process and each of its children, sampled in a thread: per run, where
  `ru_maxrss` would carry an earlier run's peak into the next one of the same process."""

  def __init__(self, interval: float = 0.1):
    self._interval, self._stop = interval, threading.Event()
    self.peak_self = psutil.Process().memory_info().rss
    self.peak_children: dict[int, int] = {}
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    me = psutil.Process()
    while not self._stop.wait(self._interval):
      self.peak_self = max(self.peak_self, me.memory_info().rss)
      for child in me.children(recursive=True):
        try:
          rss = child.memory_info().rss
        except psutil.Error:
          continue
        self.peak_children[child.pid] = max(self.peak_children.get(child.pid, 0), rss)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()


class _NoTokenizer:
  """Stands in for the tokenizer in the floor: the floor is images only."""

  longest_token_chars = 1 << 40  # no text is too long for no tokens

  def encode(self, text):
    return np.zeros(0, np.int32)

  def encode_batch(self, texts):
    return [np.zeros(0, np.int32) for _ in texts]


def _window_keys(batches: Sequence[dict]) -> list[tuple[str, int]]:
  return [(k[0], k[1]) for b in batches for keys in b["sample_keys"] for k in keys]


def _silent(line: str) -> None:
  del line


def measure_pipeline(cfg: PipelineConfig, tokenizer, *, workers: int, batch_size: int,
                     seconds: float, windows: int, warmup_batches: int = 2,
                     log: Callable[[str], None] = _silent) -> dict[str, Any]:
  """One worker count: throughput per window, main-process CPU per row, latencies, state,
  memory, slot use."""
  sampler = _RssSampler()
  rss_before_build = held_memory.snapshot()["rss_bytes"]
  start = time.perf_counter()
  it = iter(with_stage_timing(build_pipeline(cfg, tokenizer, batch_size=batch_size,
                                             workers=workers)))
  try:
    next(it)
    first_batch_s = time.perf_counter() - start
    log(f"first batch in {first_batch_s:.1f} s; {warmup_batches} warm-up batches")
    for _ in range(warmup_batches):
      next(it)
    per_window = seconds / windows
    results, keys_by_window = [], []
    cpu_start, wall_start, rows_start = time.process_time(), time.perf_counter(), \
        pipeline_stats(it)["rows"]
    inline_start, threads_start, parts_start = _inline_work(), _thread_cpu(), it.cpu_seconds()
    fills, vit_use, vae_use, image_use = [], [], [], []
    for _ in range(windows):
      before = pipeline_stats(it)
      t0, keys = time.perf_counter(), []
      while time.perf_counter() - t0 < per_window:
        batch = next(it)
        keys.extend(_window_keys([batch]))
        caps = batch["text_ids"].shape[1], batch["vit_patches"].shape[1], \
            batch["vae_token_index"].shape[1], batch["vae_images"].shape[1]
        fills.extend(batch["num_tokens"] / caps[0])
        vit_use.extend(batch["num_vit_tokens"] / caps[1])
        vae_use.extend(batch["num_vae_tokens"] / caps[2])
        image_use.extend((batch["vae_image_hw"][:, :, 0] > 0).sum(axis=1) / caps[3])
      elapsed = time.perf_counter() - t0
      after = pipeline_stats(it)
      results.append({
          "seconds": elapsed,
          "rows": after["rows"] - before["rows"],
          "packed_tokens_per_s": (after["tokens"] - before["tokens"]) / elapsed,
          "image_tokens_per_s": (after["image_tokens"] - before["image_tokens"]) / elapsed,
      })
      keys_by_window.append(keys)
      log(f"window {len(results)}/{windows}: {results[-1]['image_tokens_per_s']:,.0f} "
          f"image tokens/s")
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    inline_elements, inline_cpu_s = (b - a for a, b in zip(inline_start, _inline_work()))
    threads_cpu = {k: v - threads_start.get(k, 0.0) for k, v in _thread_cpu().items()}
    parts_cpu = _parts(threads_cpu, {k: v - parts_start[k] for k, v in it.cpu_seconds().items()})
    stats = pipeline_stats(it)
    rows = stats["rows"] - rows_start
    memory = memory_split(it, stats, rss_before_build)
    state = it.get_state()
    # Each stage's own time (Grain's stats) in the run's wall time; the rest is waiting.
    run_s = time.perf_counter() - start
    shares = {name.removesuffix("Iterator").lower(): s / run_s
              for name, s in it.stage_seconds().items()}
    shares["waiting_for_samples"] = 1.0 - sum(shares.values())
  finally:
    it.close()
  del it  # the closed pipeline's buffers are not the restore's
  # Restore from the mid-run state (buffer and carried samples re-made by key).
  t0 = time.perf_counter()
  restored = iter(build_pipeline(cfg, tokenizer, batch_size=batch_size, workers=workers))
  try:
    restored.set_state(json.loads(json.dumps(state)))
    next(restored)
    restore_s = time.perf_counter() - t0
  finally:
    restored.close()
  log(f"restored from the mid-run state in {restore_s:.2f} s")
  sampler.stop()
  main_peak = sampler.peak_self
  for worker in memory["workers"]:
    worker["peak_rss_bytes"] = sampler.peak_children.get(worker.pop("pid"), 0)
  per_row = lambda seconds: seconds / rows if rows else math.nan  # no row in the windows
  return {
      "workers": workers,
      "windows": results,
      "packed_tokens_per_s": statistics.median(r["packed_tokens_per_s"] for r in results),
      "image_tokens_per_s": statistics.median(r["image_tokens_per_s"] for r in results),
      "first_batch_s": first_batch_s,
      "restore_s": restore_s,
      "state_bytes": len(json.dumps(state)),
      "buffered_at_restore": stats["buffered"],
      "peak_rss_main_mib": main_peak / 2**20,
      "peak_rss_worker_mib": max(sampler.peak_children.values(), default=0) / 2**20,
      "main_cpu_s_per_row": per_row(cpu_s),
      "main_cpu_share": cpu_s / wall_s,  # of one core, over the timed windows
      "host_rows_per_s_implied": rows / cpu_s if rows else math.nan,
      # Of that CPU, the samples the main process decoded itself (all of them with no
      # workers; with workers, those no worker had picked up yet).
      "main_decoded_samples": inline_elements,
      "main_decode_cpu_s_per_row": per_row(inline_cpu_s),
      "main_cpu_s_per_row_by_thread": {k: per_row(v) for k, v in threads_cpu.items()},
      "main_cpu_s_per_row_by_part": {k: per_row(v) for k, v in parts_cpu.items()},
      "memory": memory,
      "row_fill": float(np.mean(fills)),
      "vit_slot_use": float(np.mean(vit_use)),
      "vae_token_slot_use": float(np.mean(vae_use)),
      "vae_image_slot_use": float(np.mean(image_use)),
      "main_process_time_share": shares,
      "drops_by_reason": stats["drops_by_reason"],
      "keys_by_window": keys_by_window,
  }


def _thread_cpu() -> dict[str, float]:
  """CPU seconds so far of this process's threads by kind: the caller's (packing,
  batching), the fetcher's pump (receiving from workers), its inline thread (decoding
  in this process), the rest (read-ahead, Grain's, the bench's own)."""
  kinds = {"MainThread": "main", "bagel-grain-fetch": "pump", "bagel-grain-inline": "decode"}
  names = {t.native_id: t.name for t in threading.enumerate()}
  out = dict.fromkeys(("main", "pump", "decode", "other"), 0.0)
  for t in psutil.Process().threads():
    out[kinds.get(names.get(t.id, ""), "other")] += t.user_time + t.system_time
  return out


def _parts(threads: dict[str, float], batching: dict[str, float]) -> dict[str, float]:
  """The main process's CPU by part of the work on a row: receiving samples (the pump),
  placement (the caller's thread: mixing, packing, the fetcher's bookkeeping), row writing,
  batch hand-off (taking and handing out buffers), decoding (samples no worker had
  picked up), the rest (read-ahead, Grain's threads)."""
  writing, hand_off = batching["row_writing"], batching["hand_off"]
  return {"pump": threads["pump"], "placement": max(0.0, threads["main"] - writing - hand_off),
          "row writing": writing, "hand-off": hand_off, "decoding": threads["decode"],
          "other": threads["other"]}


def _inline_work() -> tuple[int, float]:
  """Samples decoded in this process so far, and their CPU seconds (open fetchers)."""
  fetchers = fetcher.live()
  return sum(f.inline_elements for f in fetchers), sum(f.inline_cpu_s for f in fetchers)


def memory_split(it, stats: dict[str, Any], rss_before_build: int) -> dict[str, Any]:
  """What each process holds now, by kind, in bytes.

  main: `rss_before_build` (RSS after the imports, before building this run's
  pipeline: with earlier runs in the same process, what they left too), RSS now,
  read-ahead held (records and files read, not yet taken, or in flight), decoded
  parquet row groups cached, the packer's waiting samples (buffered and carried:
  count and bytes of their arrays) and the batch buffers (pooled: written, or held
  by the caller). Each worker: RSS after its imports (before its datasets), after
  loading its datasets, and now, with its read-ahead and row-group cache, as of the
  last element it sent.
  """
  main = held_memory.snapshot()
  buffers = it.buffer_stats()
  out = {"main": {"rss_after_imports_bytes": rss_before_build, "rss_bytes": main["rss_bytes"],
                  **{kind: main[kind] for kind in held_memory.KINDS},
                  "packer_waiting_samples": stats["buffered"] + stats["carried"],
                  "packer_waiting_bytes": stats["waiting_bytes"],
                  "batch_buffers": buffers["pooled"], "batch_buffers_held": buffers["held"],
                  "batch_buffer_bytes": buffers["pooled_bytes"],
                  "batches_into_reused_buffers": buffers["reused"],
                  "batches_into_fresh_buffers": buffers["allocated"]},
         "workers": []}
  for f in fetcher.live():
    for held in f.worker_memory():
      now = held.get("now", {})
      out["workers"].append({
          "pid": held["pid"],
          "rss_after_imports_bytes": held.get("at_hello", {}).get("rss_bytes", 0),
          "rss_datasets_loaded_bytes": held.get("at_ready", {}).get("rss_bytes", 0),
          "rss_bytes": now.get("rss_bytes", 0),
          **{kind: now.get(kind, 0) for kind in held_memory.KINDS}})
  return out


def _family_samples(cfg: PipelineConfig, seed: int):
  """Per group: records read ahead, and the family transform alone over them."""
  sources, records, samples = {}, {}, {}
  for g, group in enumerate(cfg.groups):
    sources[group.name] = group_source(cfg, g)
    records[group.name] = _ReadAhead(ShuffledRecords(
        sources[group.name], seed=group_seed(seed, g), num_epochs=cfg.num_epochs))
    # Grain seeds the family's RNG exactly as in the pipeline: same choices, same images.
    samples[group.name] = grain.MapDataset.source(records[group.name]).random_map(
        family_transform(cfg, g, _NoTokenizer()), seed=group_seed(seed, g))
  return sources, records, samples


def measure_floor(cfg: PipelineConfig, keys_by_window: Sequence[Sequence[tuple[str, int]]],
                  *, seed: int, log: Callable[[str], None] = _silent) -> dict[str, Any]:
  """Decode + RGB + resize of the same samples, alone and single-threaded, per window."""
  sources, records, samples = _family_samples(cfg, seed)
  rates = []
  for keys in keys_by_window:
    for name, index in keys:
      records[name].read(index)  # I/O outside the timed part
    tokens, t0 = 0, time.perf_counter()
    for name, index in keys:
      sample = samples[name][index]
      if isinstance(sample, Sample):
        tokens += resized_image_tokens(sample, vit_patch_size=cfg.vit_patch_size,
                                       vae_downsample=cfg.vae_image_downsample)
    rates.append(tokens / (time.perf_counter() - t0))
    log(f"window {len(rates)}/{len(keys_by_window)}: {len(keys)} samples, "
        f"{rates[-1]:,.0f} image tokens/s")
  parquet = [s for src in sources.values() for s in src.sources
             if isinstance(s, ParquetRowSource)]
  read = sum(s.bytes_read for s in parquet)
  served = sum(s.bytes_served for s in parquet)
  return {"image_tokens_per_s": statistics.median(rates), "windows": rates,
          "parquet_bytes_read_per_byte_used": read / served if served else None}


def measure_jpeg_draft(cfg: PipelineConfig, keys: Sequence[tuple[str, int]], *,
                       seed: int, max_samples: int = JPEG_DRAFT_SAMPLES,
                       log: Callable[[str], None] = _silent) -> dict[str, Any]:
  """The opt-in draft decoding against the exact path: speed-up and pixel difference."""
  keys = list(keys)[:max_samples]
  paths = {draft: _family_samples(dataclasses.replace(cfg, jpeg_draft=draft), seed)
           for draft in (False, True)}
  seconds = {False: [], True: []}
  for round_ in range(2):  # alternate, keep each path's best: no cold-start bias for either
    log(f"timing round {round_ + 1}/2: exact, then draft")
    for draft, (_, records, samples) in paths.items():
      for name, index in keys:
        records[name].read(index)
      t0 = time.perf_counter()
      for name, index in keys:
        samples[name][index]  # pylint: disable=pointless-statement
      seconds[draft].append(time.perf_counter() - t0)
  log("comparing pixels")
  total = count = largest = changed = images = 0
  for name, index in keys:  # one sample at a time: nothing accumulates
    pair = []
    for _, records, samples in paths.values():
      records[name].read(index)
      pair.append(samples[name][index])
    if not isinstance(pair[0], Sample):
      continue
    for a, b in zip(pair[0].images, pair[1].images):
      diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
      total, count = total + int(diff.sum()), count + diff.size
      largest, changed, images = max(largest, int(diff.max())), changed + bool(diff.any()), images + 1
  return {"speedup": min(seconds[False]) / min(seconds[True]),
          "mean_abs_diff": total / max(count, 1), "max_abs_diff": largest,
          "images_changed": changed, "images": images}


class _ReadAhead:
  """Records read before the clock starts, served by index."""

  def __init__(self, records: ShuffledRecords):
    self._records, self._cache = records, {}

  def read(self, index: int) -> None:
    self._cache[index] = self._records[index]

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int):
    return self._cache.pop(index)


def measure_ledger(cfg: PipelineConfig, tokenizer, *, batch_size: int, step_s: float,
                   batches: int = 10) -> dict[str, Any]:
  """The data ledger's cost (`bagel_grain.ledger`) against `step_s`, a step's data time:
  the training loop's part (keeping a batch's lines, and the segment written at a save,
  per batch) and the prefetch thread's (making the lines); its bytes per sample and per
  1M steps, beside the packed rows' token bytes (the per-position arrays)."""
  with tempfile.TemporaryDirectory() as tmp:
    ledger = Ledger(tmp)
    ledger.begin(0)
    make_s = record_s = 0.0
    samples = token_bytes = 0
    with iter(build_pipeline(cfg, tokenizer, batch_size=batch_size, workers=0)) as it:
      before = it.get_state()
      for step in range(batches):
        batch = next(it)
        after = it.get_state()
        t0 = time.perf_counter()
        lines = step_rows(batch, before, after)
        t1 = time.perf_counter()
        ledger.record(step, lines)
        record_s += time.perf_counter() - t1
        make_s += t1 - t0
        before = after
        samples += len(lines.row)
        length = batch["text_ids"].shape[1]
        token_bytes += sum(v.nbytes for k, v in batch.items() if k != "sample_keys"
                           and v.ndim == 2 and v.shape[1] == length)
    t0 = time.perf_counter()
    path = ledger.flush()
    flush_s = time.perf_counter() - t0
    size = os.path.getsize(path)
  loop_s = (record_s + flush_s) / batches
  return {"batches": batches, "samples_per_step": samples / batches,
          "loop_s_per_step": loop_s, "loop_share_of_step": loop_s / step_s,
          "lines_s_per_step": make_s / batches, "lines_share_of_step": make_s / batches / step_s,
          "bytes_per_sample": size / samples, "bytes_per_1m_steps": size / batches * 1e6,
          "share_of_token_bytes": size / token_bytes, "step_s": step_s}


def run_bench(cfg: PipelineConfig, tokenizer, *, workers: Sequence[int], seconds: float,
              windows: int = 5, batch_size: int = 1,
              log: Callable[[str], None] = _silent) -> dict[str, Any]:
  """Every worker count, then the floor on the single-threaded run's samples.

  `log` gets a line as each phase starts and as each window ends.
  """
  start = time.perf_counter()

  def phase(name: str) -> Callable[[str], None]:
    return lambda line: log(f"[{time.perf_counter() - start:6.1f} s] {name}: {line}")

  runs = []
  for w in workers:
    say = phase(f"{w} worker{'s' if w != 1 else ''}")
    say(f"pipeline from the start of the stream; then {windows} windows of "
        f"{seconds / windows:.1f} s")
    runs.append(measure_pipeline(cfg, tokenizer, workers=w, batch_size=batch_size,
                                 seconds=seconds, windows=windows, log=say))
  reference = next((r for r in runs if r["workers"] == 0), runs[0])
  say = phase("floor")
  say(f"the same samples as the {reference['workers']}-worker run, decoded and resized "
      "alone, single-threaded")
  floor = measure_floor(cfg, reference["keys_by_window"], seed=cfg.data_seed, log=say)
  keys = [k for w in reference["keys_by_window"] for k in w]
  say = phase("jpeg_draft")
  say(f"draft against exact decoding of {min(len(keys), JPEG_DRAFT_SAMPLES)} samples")
  draft = measure_jpeg_draft(cfg, keys, seed=cfg.data_seed, log=say)
  say("done")
  say = phase("ledger")
  say("the data ledger's cost per step, on 10 batches")
  ledger = measure_ledger(cfg, tokenizer, batch_size=batch_size, step_s=min(
      sum(w["seconds"] for w in r["windows"]) / max(sum(w["rows"] for w in r["windows"]), 1)
      for r in runs) * batch_size)
  say("done")
  for r in runs:
    r["ratio_to_floor"] = r["image_tokens_per_s"] / floor["image_tokens_per_s"]
    del r["keys_by_window"]
  single = reference["image_tokens_per_s"]
  for r in runs:
    r["speedup_vs_0_workers"] = r["image_tokens_per_s"] / single
  return {"floor": floor, "runs": runs, "jpeg_draft": draft, "ledger": ledger,
          "config": {"expected_num_tokens": cfg.expected_num_tokens,
                     "max_num_tokens": cfg.max_num_tokens,
                     "groups": [g.name for g in cfg.groups], "batch_size": batch_size,
                     "seconds_per_run": seconds, "windows": windows}}


def format_table(report: dict[str, Any]) -> str:
  floor = report["floor"]["image_tokens_per_s"]
  lines = [f"decode+resize floor (1 thread): {floor:,.0f} image tokens/s "
           f"(median of {len(report['floor']['windows'])} windows)",
           "workers  image tok/s  x floor  packed tok/s  first batch  restore  state  "
           "RSS main/worker MiB  fill   ViT/VAE/img slots"]
  for r in report["runs"]:
    lines.append(
        f"{r['workers']:7d}  {r['image_tokens_per_s']:11,.0f}  {r['ratio_to_floor']:7.2f}  "
        f"{r['packed_tokens_per_s']:12,.0f}  {r['first_batch_s']:9.2f} s  "
        f"{r['restore_s']:5.2f} s  {r['state_bytes']:5d}  "
        f"{r['peak_rss_main_mib']:8.0f}/{r['peak_rss_worker_mib']:<8.0f}  "
        f"{r['row_fill']:.3f}  {r['vit_slot_use']:.2f}/{r['vae_token_slot_use']:.2f}/"
        f"{r['vae_image_slot_use']:.2f}")
  d = report["jpeg_draft"]
  lines.append(f"jpeg_draft fast path (opt-in): {d['speedup']:.2f}x the exact decode+resize; "
               f"pixels differ in {d['images_changed']}/{d['images']} images, mean "
               f"{d['mean_abs_diff']:.2f}, max {d['max_abs_diff']} (uint8)")
  lines.append(ledger_line(report["ledger"]))
  ratio = report["floor"]["parquet_bytes_read_per_byte_used"]
  if ratio is not None:
    lines.append(f"parquet bytes read per byte used: {ratio:.3f} (row-group bytes decoded from "
                 "the files / record bytes the floor's samples used; above 1: decoded, unused)")
  lines.append("workers  main CPU s/row  main busy (of 1 core)  host rows/s implied  "
               "of the CPU: decoding in main (samples)")
  for r in report["runs"]:
    lines.append(f"{r['workers']:7d}  {r['main_cpu_s_per_row']:13.4f}  "
                 f"{r['main_cpu_share']:21.0%}  {r['host_rows_per_s_implied']:19,.1f}  "
                 f"{r['main_decode_cpu_s_per_row']:.4f} s/row ({r['main_decoded_samples']})")
  lines.append("(host rows/s implied = 1 / main CPU s per row: where the main process alone "
               "would be saturated; CPU of all its threads, over the timed windows)")
  for r in report["runs"]:
    split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["main_cpu_s_per_row_by_part"].items())
    lines.append(f"workers={r['workers']}: main CPU ms per row by part: {split}")
  for r in report["runs"]:
    shares = ", ".join(f"{k} {v:.0%}" for k, v in r["main_process_time_share"].items())
    lines.append(f"workers={r['workers']}: main process time: {shares}")
  lines.append("memory by process, MiB (at the end of the timed windows): RSS after imports / "
               "now / peak; read-ahead held; parquet row groups cached; packer's waiting "
               "samples; batch buffers (pooled, held by the caller)")
  for r in report["runs"]:
    lines.extend(_memory_lines(r))
  return "\n".join(lines)


def ledger_line(ledger: dict[str, Any]) -> str:
  """The data ledger's costs, as `format_table` prints them."""
  return (f"data ledger (opt-in): training loop {ledger['loop_s_per_step'] * 1e6:.0f} us/step "
          f"({ledger['loop_share_of_step']:.3%} of a step's data time, "
          f"{ledger['step_s'] * 1e3:.0f} ms), prefetch thread "
          f"{ledger['lines_s_per_step'] * 1e6:.0f} us/step "
          f"({ledger['lines_share_of_step']:.3%}); {ledger['bytes_per_sample']:.1f} bytes/sample, "
          f"{ledger['bytes_per_1m_steps'] / 2**20:,.0f} MiB per 1M steps "
          f"({ledger['share_of_token_bytes']:.4%} of the packed token bytes)")


def _memory_lines(run: dict[str, Any]) -> list[str]:
  m, mib = run["memory"], lambda n: f"{n / 2**20:,.0f}"
  main = m["main"]
  lines = [f"workers={run['workers']}: main: RSS {mib(main['rss_after_imports_bytes'])} / "
           f"{mib(main['rss_bytes'])} / {run['peak_rss_main_mib']:,.0f}; read-ahead "
           f"{mib(main['read_ahead_bytes'])}; row groups {mib(main['row_group_cache_bytes'])}; "
           f"packer {main['packer_waiting_samples']} samples, "
           f"{mib(main['packer_waiting_bytes'])}; batch buffers {main['batch_buffers']} "
           f"({main['batch_buffers_held']} held), {mib(main['batch_buffer_bytes'])} "
           f"({main['batches_into_reused_buffers']} batches into reused buffers, "
           f"{main['batches_into_fresh_buffers']} into fresh)"]
  for i, w in enumerate(m["workers"]):
    lines.append(f"workers={run['workers']}: worker {i}: RSS {mib(w['rss_after_imports_bytes'])}"
                 f" / {mib(w['rss_bytes'])} / {mib(w['peak_rss_bytes'])} (datasets loaded: "
                 f"{mib(w['rss_datasets_loaded_bytes'])}); read-ahead "
                 f"{mib(w['read_ahead_bytes'])}; row groups {mib(w['row_group_cache_bytes'])}")
  return lines


def _tick_step(top: float, ticks: int = 5) -> float:
  """A round step (1, 2 or 5 times a power of ten) giving about `ticks` ticks up to `top`."""
  rough = top / ticks
  power = 10 ** math.floor(math.log10(rough))
  return next(m * power for m in (1, 2, 5, 10) if m * power >= rough)


def _short(value: float) -> str:
  return f"{value / 1e6:.1f}M" if value >= 1e6 else f"{value / 1e3:.0f}k" if value >= 1e3 \
      else f"{value:.0f}"


def plot(report: dict[str, Any], path: str) -> None:
  """A PNG of image tokens/s against worker count, with the floor as a line (Pillow only)."""
  from PIL import Image, ImageDraw, ImageFont  # pylint: disable=import-outside-toplevel
  runs = report["runs"]
  floor = report["floor"]["image_tokens_per_s"]
  w, h = 640, 400
  left, right, top_m, bottom = 70, 20, 50, 50  # margins around the plot area
  top = max([r["image_tokens_per_s"] for r in runs] + [floor]) * 1.15
  font, title_font = ImageFont.load_default(size=11), ImageFont.load_default(size=14)
  img = Image.new("RGB", (w, h), "white")
  d = ImageDraw.Draw(img)
  y = lambda v: h - bottom - v / top * (h - bottom - top_m)
  bar_colour, floor_colour = (70, 110, 200), (230, 120, 20)
  d.text((w // 2, 8), "bagel-grain bench: image tokens/s by worker processes", fill="black",
         font=title_font, anchor="mt")
  legend = [(bar_colour, f"pipeline, median of {report['config']['windows']} windows "
             "(x ratio to the floor)"),
            (floor_colour, f"decode+resize floor, 1 thread: {floor:,.0f}")]
  x = left
  for colour, text in legend:
    d.rectangle([x, 31, x + 14, 37], fill=colour)
    d.text((x + 19, 34), text, fill="black", font=font, anchor="lm")
    x += 19 + d.textlength(text, font=font) + 18
  step = _tick_step(top)
  for i in range(int(top // step) + 1):
    v = i * step
    d.line([(left - 4, y(v)), (w - right, y(v))], fill=(225, 225, 225) if i else "black")
    d.text((left - 6, y(v)), _short(v), fill="black", font=font, anchor="rm")
  d.line([(left, top_m - 6), (left, h - bottom)], fill="black")
  label = Image.new("RGB", (200, 14), "white")
  ImageDraw.Draw(label).text((100, 7), "image tokens / s", fill="black", font=font, anchor="mm")
  img.paste(label.rotate(90, expand=True), (4, (h - bottom + top_m) // 2 - 100))
  slot = (w - left - right) / len(runs)
  for i, r in enumerate(runs):
    x, v = left + (i + 0.5) * slot, r["image_tokens_per_s"]
    d.rectangle([x - 24, y(v), x + 24, h - bottom], fill=bar_colour)
    d.text((x, y(v) - 3), f"{_short(v)} ({r['ratio_to_floor']:.2f}x)", fill="black", font=font,
           anchor="mb")
    d.text((x, h - bottom + 5), str(r["workers"]), fill="black", font=font, anchor="mt")
  d.text(((left + w - right) // 2, h - bottom + 24), "worker processes", fill="black", font=font,
         anchor="mt")
  for x0 in range(left, w - right, 12):  # dashed, drawn over the bars
    d.line([(x0, y(floor)), (min(x0 + 7, w - right), y(floor))], fill=floor_colour, width=2)
  d.text((left + 4, y(floor) - 3), "floor", fill=floor_colour, font=font, anchor="lb")
  img.save(path)
