"""Soak run: the pipeline with worker processes for minutes on demo data with injected bad records.

Writes a corrupted copy of the demo data (a `--bad-fraction` of T2I images, edit
chains and VLM lines replaced by bad ones) with a few hostile records besides (a
few megabytes of text in a caption, an instruction and a VLM turn, an image file
larger than `max_image_bytes`, a FIFO where an image should be, a 16-bit grey
PNG of 9 Mpx, a T2I parquet file whose footer claims twice the rows it holds;
and, built apart, one claiming 1e9 rows, which the build must refuse; codec inputs:
an EPS file with a `gs` on PATH that records any call, a 1010-scan progressive
JPEG, a VLM line naming a file 10,000 times, a parquet cell over
`max_image_bytes`; video files: an MKV of 2M tiny packets, an MP4 whose tables claim
85M samples, an MJPEG AVI whose frame 2 is 16000x16000, an MKV of 1,000 streams), then
pulls batches for the given time. Every `--report-every`
seconds it prints the elapsed time, rows, each process's RSS split into anonymous,
file and shared-memory pages (MiB), and the packer's counters with whether they
balance (drawn = packed + dropped + buffered + carried). Memory is read from /proc
every `--sample-every` seconds (`tools/proc_memory.py`; `--series` writes the
samples). At the end it prints a JSON summary: per process and half of the run, the
peak and median of RSS and of each kind of page, the true peak RSS (`VmHWM`, restarted
at half time), and their growth; for the main process, which object types grew in
number (and, with `--tracemalloc`, which lines allocated more). Memory is flat when no
process's anonymous pages grew by more than `--anon-tolerance-mib` (peak and median)
from one half to the next: shared pages (memory another process wrote, counted in
each process that reads it) are judged apart, bounded by the shared mappings. The
exit status is 1 when memory was not flat, the counters ever failed to balance, the
stream stopped with an error, a worker process was replaced, or a record started a
process.

With `--storage` a second VLM dataset lies in a local S3 server behind the test
fault proxy (`tests/object_store`, the test extra), with one record per storage
row of `STORAGE_ROWS` each epoch: an image served at 3 bytes a second (re-armed
every `--storage-every` seconds: a `StorageUnavailableError`, counted, then the
same `next()` again), an image claiming 10^12 bytes (`file_too_large`), a frame
folder whose LIST repeats its token (`file_not_readable`) and one of 1M keys
(`too_many_video_frames`).

    python tools/soak.py --minutes 10
    python tools/soak.py --seconds 20 --report-every 5 --anon-tolerance-mib 4096  # smoke run
    python tools/soak.py --minutes 10 --storage             # with the storage rows
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

import proc_memory  # tools/, beside this file

ROOT = Path(__file__).resolve().parents[1]
GARBAGE = b"soak: these bytes are not an image"
_TURNS = '[{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "?"}]'
BAD_LINES = (  # VLM lines, each one a different kind of bad record
    "this line is not JSON",
    '{"image": "../../outside.png", "conversations": %s}' % _TURNS,
    '{"image": "images/soak_garbage.png", "conversations": %s}' % _TURNS,
    '{"image": "images/soak_missing.png", "conversations": %s}' % _TURNS,
)
BIG_TEXT = "hostile " * 640_000  # 5 MiB: more than any sample holds (text_too_long)
HOSTILE_LINES = (  # VLM lines a hostile user writes, each once per epoch
    '{"image": "images/soak_huge.png", "conversations": %s}' % _TURNS,  # file_too_large
    '{"image": "images/soak_fifo.png", "conversations": %s}' % _TURNS,  # not_a_regular_file
    '{"image": "images/soak_grey16.png", "conversations": %s}' % _TURNS,  # packed: 9 Mpx
    json.dumps({"image": "images/soak_garbage.png", "conversations": [
        {"from": "human", "value": "<image>" + BIG_TEXT}, {"from": "gpt", "value": "?"}]}),
)
# The soak's `max_image_bytes` (soak_huge.png and the parquet cell are one byte more):
# a quarter of the default, because Arrow's read of a cell just over it costs about three
# times the cell (docs/images.md), so at 128 MiB that one read lifts a process past the
# soak's 1 GiB bound whatever the pipeline does.
MAX_IMAGE_BYTES = 32 << 20
ANON_TOLERANCE_MIB = 16.0  # the default of --anon-tolerance-mib


def _hostile_files(images: Path) -> None:
  """The files HOSTILE_LINES name: sparse, special, large to decode."""
  with open(images / "soak_huge.png", "wb") as f:
    f.truncate(MAX_IMAGE_BYTES + 1)  # sparse: no disk used
  os.mkfifo(images / "soak_fifo.png")
  ramp = np.linspace(0, 60000, 3000, dtype=np.float64)
  Image.fromarray(np.add.outer(ramp, ramp[:2000]).astype(np.uint16) // 2).save(
      images / "soak_grey16.png", compress_level=1)


_CODEC_FILES = """
import io, json, sys
import pyarrow as pa, pyarrow.parquet as pq
from PIL import Image
images, t2i, max_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = io.BytesIO()
Image.new('RGB', (8000, 8000), (120, 60, 30)).save(out, 'JPEG', progressive=True)
jpeg = out.getvalue()
last = jpeg.rfind(b'\\xff\\xda')
bomb = jpeg[:last] + jpeg[last:-2] * 1001 + b'\\xff\\xd9'  # 1010 scans
eps = (b'%!PS-Adobe-3.0 EPSF-3.0\\n%%BoundingBox: 0 0 10 10\\n%%EndComments\\n'
       b'newpath 0 0 moveto 10 10 lineto stroke showpage\\n%%EOF\\n')
open(images + '/soak_eps.png', 'wb').write(eps)
open(images + '/soak_scan_bomb.jpg', 'wb').write(bomb)
good = io.BytesIO()
Image.new('RGB', (64, 64), (0, 90, 0)).save(good, 'PNG')
pq.write_table(pa.table({
    'image': [good.getvalue(), bytes(max_bytes + 1), eps, bomb],  # + a cell over the limit
    'captions': [json.dumps({'a': 'soak codec row'})] * 4}),
    t2i + '/soak_codecs.parquet', compression='zstd')
"""
CODEC_LINES = (  # VLM lines with hostile image files, each once per epoch
    '{"image": "images/soak_eps.png", "conversations": %s}' % _TURNS,  # bad_image, no gs
    '{"image": "images/soak_scan_bomb.jpg", "conversations": %s}' % _TURNS,  # too_many_jpeg_scans
    json.dumps({"image": ["images/soak_eps.png"] * 10_000, "conversations": [  # over_max_tokens
        {"from": "human", "value": "<image>" * 10_000}, {"from": "gpt", "value": "?"}]}),
)


def _codec_inputs(out: Path) -> dict[str, int]:
  """Hostile codec inputs, each once per epoch: an EPS file (Ghostscript would render
  it), a progressive 8000x8000 JPEG of 1010 scans, a VLM line naming a file 10,000
  times, and a T2I parquet file holding those beside a cell over `max_image_bytes`
  (written by another process: its 128 MiB never count against this one). Returns
  the bad records added per group."""
  subprocess.run([sys.executable, "-c", _CODEC_FILES, str(out / "vlm" / "images"),
                  str(out / "t2i"), str(MAX_IMAGE_BYTES)], check=True)
  with open(out / "vlm" / "sft.jsonl", "a", encoding="utf-8") as f:
    f.write("\n".join(CODEC_LINES) + "\n")
  return {"t2i_pretrain": 3, "vlm_sft": len(CODEC_LINES)}


_VIDEO_FILES = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from hostile_videos import (many_packets_mkv, many_streams_mkv, mjpeg_avi_growing_frame,
                            mp4_claiming_samples)
from video_files import VideoSpec, write_video
out = Path(sys.argv[1])
many_packets_mkv(out / "soak_packets.mkv", 2_000_000)
source = write_video(out, VideoSpec("soak_source.mp4", size=(64, 48), frames=24))
mp4_claiming_samples(source, out / "soak_claims.mp4", 85_000_000)
mjpeg_avi_growing_frame(out / "soak_grows.avi")
many_streams_mkv(out / "soak_streams.mkv", 1000)
"""
_VIDEO_TURNS = [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "?"}]
VIDEO_LINES = tuple(  # VLM lines with hostile video files (issue 27), each once per epoch
    json.dumps({"video": f"videos/{name}", "conversations": _VIDEO_TURNS})
    for name in ("soak_packets.mkv",  # 2M one-byte packets, 14 MB: too_many_video_frames
                 "soak_claims.mp4",  # sample tables claiming 85M samples: too_many_video_frames
                 "soak_grows.avi",  # frame 2 of an MJPEG AVI is 16000x16000: too_many_pixels
                 "soak_streams.mkv"))  # 1,000 video streams: video_unreadable


def _video_inputs(out: Path) -> dict[str, int]:
  """Hostile video files, each once per epoch (a low rate: the demo's epoch is ~70
  lines): written by another process, from tests/hostile_videos.py. Returns the bad
  records added per group."""
  videos = out / "vlm" / "videos"
  videos.mkdir(exist_ok=True)
  subprocess.run([sys.executable, "-c", _VIDEO_FILES, str(videos), str(ROOT / "tests")],
                 check=True)
  with open(out / "vlm" / "sft.jsonl", "a", encoding="utf-8") as f:
    f.write("\n".join(VIDEO_LINES) + "\n")
  return {"vlm_sft": len(VIDEO_LINES)}


def install_recording_gs(folder: Path) -> Path:
  """A `gs` first on PATH (for this process and the workers it starts) that records
  every call in the returned log: a record that starts a process shows up there."""
  log = folder / "gs_calls.log"
  gs = folder / "gs"
  gs.write_text(f'#!/bin/sh\necho "gs $*" >> "{log}"\nexit 1\n')
  gs.chmod(0o755)
  os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
  return log


def _chosen(n: int, fraction: float, rng: random.Random) -> set[int]:
  return set(rng.sample(range(n), max(1, round(n * fraction)))) if n else set()


def _corrupt_parquet(src: Path, dst: Path, fraction: float, rng: random.Random) -> int:
  """Copies a parquet file with a `fraction` of its rows' images replaced by garbage."""
  meta = pq.read_metadata(src)
  rows = pq.read_table(src).to_pylist()
  bad = _chosen(len(rows), fraction, rng)
  for i in bad:
    if "image" in rows[i]:
      rows[i]["image"] = GARBAGE
    else:  # an edit chain: every image, so whichever the chain starts on is bad
      rows[i]["image_list"] = [GARBAGE] * len(rows[i]["image_list"])
  hostile = next(i for i in range(len(rows)) if i not in bad)  # megabytes of text
  if "captions" in rows[hostile]:
    rows[hostile]["captions"] = json.dumps({"long": BIG_TEXT})
  else:
    rows[hostile]["instruction_list"] = [[BIG_TEXT]] * len(rows[hostile]["instruction_list"])
  pq.write_table(pa.Table.from_pylist(rows, schema=meta.schema.to_arrow_schema()), dst,
                 row_group_size=meta.row_group(0).num_rows)
  return len(bad) + 1


LYING_FOOTER_ROWS = 4  # rows the lying file holds; its footer claims twice as many


def lying_footer_file(t2i: Path) -> int:
  """A T2I parquet file whose footer claims more rows than it holds, every count edited
  alike (it passes the footer checks): its missing rows are dropped as `unreadable_file`
  each epoch. Returns how many. A footer that contradicts itself is refused at build
  time instead (`impossible_footer_refused`)."""
  sys.path.insert(0, str(ROOT / "tests"))
  import lying_parquet  # pylint: disable=import-outside-toplevel
  src = sorted(t2i.glob("*.parquet"))[0]
  path = t2i / "soak_lying_footer.parquet"
  pq.write_table(pq.read_table(src).slice(0, LYING_FOOTER_ROWS), path)
  lying_parquet.claim_rows(path, 0, 2 * LYING_FOOTER_ROWS, consistent=True)
  return LYING_FOOTER_ROWS


def impossible_footer_refused(t2i: Path, tmp: Path) -> str | None:
  """Builds a catalog over a copy of `t2i` plus a file claiming 1e9 rows for 4: the build
  must refuse it naming the file, before anything is sized by the claim. Returns the
  error's text, or None when it was not refused."""
  # pylint: disable=import-outside-toplevel
  import lying_parquet
  from bagel_grain.errors import DatasetError
  from bagel_grain.sources.parquet import dataset_catalog
  folder = tmp / "impossible_footer"
  shutil.copytree(t2i, folder)
  (folder / "soak_lying_footer.parquet").unlink(missing_ok=True)
  path = folder / "zz_impossible.parquet"
  pq.write_table(pq.read_table(sorted(t2i.glob("*.parquet"))[0]).slice(0, 4), path)
  lying_parquet.claim_rows(path, 0, 10**9)
  try:
    dataset_catalog(str(folder), None, ["image", "captions"]).blocks(0, 1 << 30)
  except DatasetError as e:
    return str(e) if str(path) in str(e) else None
  return None


def corrupted_copy(demo: Path, out: Path, fraction: float, seed: int) -> dict[str, int]:
  """Writes the demo data with bad records into `out`; returns how many per group."""
  rng = random.Random(seed)
  injected = {"t2i_pretrain": 0, "unified_edit": 0, "vlm_sft": 0}
  for folder, group in (("t2i", "t2i_pretrain"), ("edit", "unified_edit")):
    (out / folder).mkdir(parents=True)
    for src in sorted((demo / folder).glob("*.parquet")):
      injected[group] += _corrupt_parquet(src, out / folder / src.name, fraction, rng)
  injected["t2i_pretrain"] += lying_footer_file(out / "t2i")
  shutil.copytree(demo / "vlm", out / "vlm")
  (out / "vlm" / "images" / "soak_garbage.png").write_bytes(GARBAGE)
  _hostile_files(out / "vlm" / "images")
  lines = (out / "vlm" / "sft.jsonl").read_text().splitlines()
  for k, i in enumerate(sorted(_chosen(len(lines), fraction, rng))):
    lines[i] = BAD_LINES[k % len(BAD_LINES)]
    injected["vlm_sft"] += 1
  lines += HOSTILE_LINES
  injected["vlm_sft"] += len(HOSTILE_LINES) - 1  # the 16-bit image is a good record
  (out / "vlm" / "sft.jsonl").write_text("\n".join(lines) + "\n")
  for group, count in _codec_inputs(out).items():
    injected[group] += count
  for group, count in _video_inputs(out).items():
    injected[group] += count
  info = {"t2i_pretrain": {"demo_t2i": {"data_dir": "t2i"}},
          "unified_edit": {"demo_edit": {"data_dir": "edit"}},
          "vlm_sft": {"demo_vlm": {"data_dir": "vlm", "jsonl_path": "vlm/sft.jsonl"}}}
  (out / "dataset_info.yaml").write_text(yaml.safe_dump(info))
  return injected


# -- storage rows: a sick object store, at a low rate -------------------------------------

_VIDEO_TURNS = '[{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "?"}]'
STORAGE_ROWS = (  # (object or frame folder in the bucket, fault, the line naming it)
    ("images/soak_slow.png", "slow", '{"image": "images/soak_slow.png", "conversations": %s}'
     % _TURNS),  # a StorageUnavailableError while armed, then packed
    ("images/soak_claim.png", "huge", '{"image": "images/soak_claim.png", "conversations": %s}'
     % _TURNS),  # file_too_large
    ("videos/soak_loop/", "loop_list", '{"video": "videos/soak_loop/", "conversations": %s}'
     % _VIDEO_TURNS),  # file_not_readable
    ("videos/soak_many/", "many_keys", '{"video": "videos/soak_many/", "conversations": %s}'
     % _VIDEO_TURNS),  # too_many_video_frames
)
GOOD_BUCKET_LINES = 20  # demo lines beside them, so that the faulty ones come at a low rate
NOT_WORKERS: set[int] = set()  # child processes that are not the pool's (the S3 server)


@contextlib.contextmanager
def storage_rows(demo: Path, tmp: Path, faults=tuple(r[1] for r in STORAGE_ROWS)):
  """A VLM dataset in a local S3 server behind a fault proxy, the environment pointing
  at it; yields (its dataset_info entry, a function that re-arms the slow object); the
  server's and proxy's processes are listed in `NOT_WORKERS` while they run. `faults`: the
  rows of `STORAGE_ROWS` to write, by fault (to find which one grows what)."""
  rows = [r for r in STORAGE_ROWS if r[1] in faults]
  sys.path.insert(0, str(ROOT / "tests"))
  from object_store import LocalObjectStore  # pylint: disable=import-outside-toplevel
  folder = tmp / "bucket"
  shutil.copytree(demo / "vlm", folder)
  lines = (folder / "sft.jsonl").read_text().splitlines()[:GOOD_BUCKET_LINES]
  (folder / "sft.jsonl").write_text("\n".join(lines + [r[2] for r in rows]) + "\n")
  first_image = sorted((folder / "images").iterdir())[0]
  for name in ("soak_slow.png", "soak_claim.png"):
    shutil.copy(first_image, folder / "images" / name)
  first_clip = sorted((folder / "videos").iterdir())[0]
  shutil.copytree(first_clip, folder / "videos" / "soak_loop")
  saved = dict(os.environ)
  with LocalObjectStore("s3") as store:
    root = store.upload(str(folder), "soak")
    proxy = store.fault_proxy()
    os.environ.update(store.environment(proxy.port))
    for path, fault, _ in rows:
      if fault != "slow":  # for good; the slow one is armed by `rearm`
        proxy.fault(fault, match=f"soak/{path}" if not path.endswith("/")
                    else f"prefix=soak/{path}")

    def rearm() -> None:
      proxy.fault("slow", count=2, match="soak/images/soak_slow.png")  # ahead, and again

    NOT_WORKERS.update(store.pids())
    try:
      yield {"data_dir": root, "jsonl_path": f"{root}/sft.jsonl"}, rearm
    finally:
      NOT_WORKERS.difference_update(store.pids())
      os.environ.clear()
      os.environ.update(saved)


def _workers(me: psutil.Process) -> list[psutil.Process]:
  """The pool's worker processes (multiprocessing's resource tracker is not one)."""
  out = []
  for child in me.children(recursive=True):
    try:
      if child.pid not in NOT_WORKERS and "resource_tracker" not in " ".join(child.cmdline()):
        out.append(child)
    except psutil.Error:
      pass
  return out


def soak(args) -> dict:
  # pylint: disable=import-outside-toplevel
  from bagel_grain.config import config_from_dict
  from bagel_grain.tooling.demo_data import make_sample_data
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.tokenizer import load_tokenizer

  tmp = Path(tempfile.mkdtemp(prefix="bagel_soak_"))
  try:
    gs_log = install_recording_gs(tmp)
    demo = Path(args.data) if args.data else make_sample_data(tmp / "demo")
    injected = corrupted_copy(demo, tmp / "corrupted", args.bad_fraction, args.seed)
    refused = impossible_footer_refused(tmp / "corrupted" / "t2i", tmp)
    raw = yaml.safe_load(Path(args.config).read_text())
    raw.update(dataset_info=str(tmp / "corrupted" / "dataset_info.yaml"),
               tokenizer_path=str(demo / "tokenizer"), num_epochs=None,
               max_image_bytes=MAX_IMAGE_BYTES)
    if args.element_timeout_s is not None:  # --storage sets its own (the 30 s)
      raw["element_timeout_s"] = args.element_timeout_s
    with contextlib.ExitStack() as stack:
      rearm = None
      if args.storage:
        faults = args.storage_faults.split(",")
        entry, rearm = stack.enter_context(storage_rows(demo, tmp, faults))
        _add_dataset(tmp / "corrupted" / "dataset_info.yaml", raw, "soak_bucket", entry)
        raw.update(storage_timeout_s=24, element_timeout_s=30)  # the settings
        injected["vlm_sft"] += len(faults) - ("slow" in faults)  # the slow one is packed
      cfg = config_from_dict(raw, file=args.config, base_dir=str(Path(args.config).parent))
      tokenizer = load_tokenizer(demo / "tokenizer" / "tokenizer.json")
      it = iter(build_pipeline(cfg, tokenizer, batch_size=args.batch_size,
                               workers=args.workers))
      summary = _run(it, pipeline_stats, args, injected, rearm)
    summary["impossible_footer_refused"] = refused
    summary["processes_started_by_records"] = (
        gs_log.read_text().count("gs ") if gs_log.exists() else 0)
    return summary
  finally:
    if not args.keep:
      shutil.rmtree(tmp, ignore_errors=True)


def _add_dataset(info_path: Path, raw: dict, name: str, entry: dict) -> None:
  """One more dataset in the VLM group: in dataset_info.yaml and in the config."""
  info = yaml.safe_load(info_path.read_text())
  info["vlm_sft"][name] = entry
  info_path.write_text(yaml.safe_dump(info))
  raw["grouped_datasets"]["vlm_sft"]["dataset_names"].append(name)


def _run(it, pipeline_stats, args, injected, rearm=None) -> dict:
  # pylint: disable=import-outside-toplevel
  from bagel_grain.errors import StorageUnavailableError
  from bagel_grain.workers.fetcher import live
  me = psutil.Process()
  duration = args.seconds if args.seconds is not None else args.minutes * 60
  start = time.monotonic()
  next_report = start + args.report_every
  rows = batches = storage_errors = 0
  next_rearm = start
  balanced, error = True, None
  stats = {}
  if args.tracemalloc:
    tracemalloc.start(args.tracemalloc)
  watch = proc_memory.Watch(
      lambda: {"main": me.pid, **{f"worker {p.pid}": p.pid for p in _workers(me)}},
      half=duration / 2, every=args.sample_every).start()

  def mib(name, field):
    s = watch.latest(name)
    return f"{s[field]:.0f}" if s else "-"

  arena_trace = []  # --malloc-trace: the main process's arenas at each report

  def trace_arenas(now):
    arenas = proc_memory.malloc_arenas() or []
    arena_trace.append({
        "t": round(now - start, 1), "rows": rows, "load": os.getloadavg()[0],
        "mmap_threshold": proc_memory.mmap_threshold_probe(),
        "c_heap": proc_memory.malloc_mib(),
        "thread_arena_rss_mib": proc_memory.thread_arena_mib(me.pid),
        "threads": [t.name for t in threading.enumerate()],
        "arenas": arenas})

  def report(now):
    watch.sample()
    if args.malloc_trace:
      trace_arenas(now)
    s = stats
    ok = s["drawn"] == s["packed"] + s["dropped"] + s["buffered"] + s["carried"]
    memory = "  ".join(f"{name} {mib(name, 'VmRSS')} ({mib(name, 'RssAnon')}/"
                       f"{mib(name, 'RssFile')}/{mib(name, 'RssShmem')})"
                       for name in ["main"] + sorted(n for n in watch.series if n != "main"))
    print(f"[{now - start:7.1f} s] rows {rows:6d}  rss MiB (anon/file/shmem): {memory}  "
          f"drawn {s['drawn']} = packed {s['packed']} + dropped {s['dropped']} + buffered "
          f"{s['buffered']} + carried {s['carried']}: {'balanced' if ok else 'NOT BALANCED'}",
          flush=True)

  try:
    while time.monotonic() - start < duration:
      if rearm is not None and time.monotonic() >= next_rearm:
        rearm()
        next_rearm = time.monotonic() + args.storage_every
      try:
        batch = next(it)
      except StorageUnavailableError:  # the slow object: the iterator stays, read it again
        storage_errors += 1
        continue
      batches += 1
      rows += sum(1 for keys in batch["sample_keys"] if keys)
      stats = pipeline_stats(it)
      if stats["drawn"] != (stats["packed"] + stats["dropped"] + stats["buffered"]
                            + stats["carried"]):
        balanced = False
      now = time.monotonic()
      if now >= next_report:
        report(now)
        next_report = now + args.report_every
  except KeyboardInterrupt:
    print("interrupted", flush=True)
  except Exception as e:  # the soak's verdict: any error that stops the stream is reported
    error = f"{type(e).__name__}: {e}"
  finally:
    elapsed = time.monotonic() - start
    if stats:
      report(time.monotonic())
    if args.malloc_trace:
      trace_arenas(time.monotonic())
      Path(args.malloc_trace).write_text(json.dumps(arena_trace) + "\n")
    watch.stop()  # before close: the workers' last samples and peaks
    decoded_here = sum(f.inline_elements for f in live())  # before close forgets them
    trims = (sum(f.heap_trims for f in live()), sum(f.heap_trim_s for f in live()))
    it.close()
  time.sleep(0.5)
  left = [p.pid for p in _workers(me) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
  drawn = stats.get("drawn", 0)
  return {
      "seconds": round(elapsed, 1),
      "workers": args.workers,
      "batches": batches,
      "rows": rows,
      "rows_per_s": round(rows / elapsed, 2) if elapsed else 0.0,
      "counters": {k: stats.get(k, 0) for k in ("drawn", "packed", "dropped", "buffered",
                                                "carried")},
      "balanced": balanced,
      "injected_per_epoch": injected,
      "drop_fraction": round(stats.get("dropped", 0) / drawn, 4) if drawn else 0.0,
      "drops_by_reason": stats.get("drops_by_reason", {}),
      "epochs": stats.get("epoch", {}),
      "memory": watch.summary(args.anon_tolerance_mib),
      "memory_series": watch.series_json(),
      "worker_pids_seen": sum(1 for name in watch.series if name != "main"),
      "workers_left_after_close": left,
      "storage_errors": storage_errors,
      # elements the main process computed itself (workers busy, or not up yet): its
      # memory follows them, not the workers'
      "main_decoded_elements": decoded_here,
      # how often the main process gave its malloc arenas' freed pages back meanwhile, and
      # the seconds that took (`c_heap.release_freed`, at most every `c_heap.TRIM_INTERVAL_S`)
      "main_heap_trims": trims[0],
      "main_heap_trim_s": round(trims[1], 3),
      "error": error,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--minutes", type=float, default=10.0)
  parser.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=2)
  parser.add_argument("--bad-fraction", type=float, default=0.05)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--report-every", type=float, default=30.0, help="seconds")
  parser.add_argument("--config", default=str(ROOT / "bagel_grain" / "configs" / "demo.yaml"))
  parser.add_argument("--data", help="an existing demo dataset (default: generate one)")
  parser.add_argument("--json", help="also write the summary here")
  parser.add_argument("--keep", action="store_true", help="keep the temporary data")
  parser.add_argument("--storage", action="store_true",
                      help="add the storage rows (a local S3 server behind a fault proxy)")
  parser.add_argument("--storage-faults", default=",".join(r[1] for r in STORAGE_ROWS),
                      help="which storage rows, by fault (comma-separated)")
  parser.add_argument("--storage-every", type=float, default=120.0,
                      help="seconds between two arms of the slow object")
  parser.add_argument("--element-timeout-s", type=float, default=None,
                      help="the config's element_timeout_s (e.g. 5: no hostile record may "
                           "hold an element that long)")
  parser.add_argument("--sample-every", type=float, default=1.0,
                      help="seconds between two memory samples")
  parser.add_argument("--anon-tolerance-mib", type=float, default=ANON_TOLERANCE_MIB,
                      help="the most a process's anonymous memory may grow from the first "
                           "half to the second (peak and median) for the run to be flat")
  parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                      help="trace the main process's allocations (slow): their top growth "
                           "from the first half to the second")
  parser.add_argument("--malloc-trace", metavar="FILE",
                      help="at each report, write the main process's glibc arenas "
                           "(malloc_info: size, free, free in chunks of 128 KiB or more, top), "
                           "its mmap threshold (probed) and its threads here (JSON)")
  parser.add_argument("--main-mmap-threshold", type=int, default=0, metavar="BYTES",
                      help="an experiment: mallopt(M_MMAP_THRESHOLD, BYTES) in the main "
                           "process (not the workers) before the pipeline starts")
  parser.add_argument("--main-trim-threshold", type=int, default=None, metavar="BYTES",
                      help="the main process's c_heap.MAIN_TRIM_THRESHOLD for this run (0: "
                           "glibc's own, moving threshold, as before 2026-12-03)")
  parser.add_argument("--series", help="write each process's memory samples here (JSON)")
  args = parser.parse_args(argv)
  if args.main_trim_threshold is not None:
    from bagel_grain import c_heap  # pylint: disable=import-outside-toplevel
    c_heap.MAIN_TRIM_THRESHOLD = args.main_trim_threshold or None
  if args.main_mmap_threshold:
    proc_memory.set_mmap_threshold(args.main_mmap_threshold)
  summary = soak(args)
  series = summary.pop("memory_series")
  if args.series:
    Path(args.series).write_text(json.dumps(series) + "\n")
  text = json.dumps(summary, indent=1)
  print(text)
  if args.json:
    Path(args.json).write_text(text + "\n")
  print(f"memory: {'flat' if summary['memory']['flat'] else 'GROWING'}"
        + "".join(f"\n  {r}" for r in summary["memory"]["reasons"]), flush=True)
  failed = (not summary["balanced"] or summary["error"] is not None
            or summary["impossible_footer_refused"] is None
            or summary["processes_started_by_records"]
            or summary["workers_left_after_close"]
            or summary["worker_pids_seen"] > max(args.workers, 0)
            or not summary["memory"]["flat"])
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
