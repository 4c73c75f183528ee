"""What hostile inputs cost now: per case, the outcome, its time and the peak memory.

Each case runs in a fresh process on the demo data (`--data`, written by
`bagel-grain make-sample-data`): the hostile step alone is timed, and the
process's peak RSS is reset just before it (Linux: /proc/self/clear_refs), so the
growth reported is what that step took. Cases: megabytes of text in a VLM turn
and a T2I caption, a 2 GiB (sparse) image file, a FIFO, a socket and a device
node where an image should be (0 and 2 workers through the whole pipeline), a
read that stalls, a state holding 100,000 buffered keys, and T2I parquet files of
one huge row group each (0 and 2 workers; peaks of the main process and of each
worker, the resource tracker among them); codec inputs: an EPS file in a T2I row
and a VLM line with a `gs` on PATH that records any call, an ICO hiding an
8000x8000 PNG, a progressive 8000x8000 JPEG of 1010 scans, a VLM line naming one
image 10,000 times, a 300 MB image cell in a small zstd parquet file.

    python tools/hostile_rows.py --data .demo_data
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_PRELUDE = """
import json, os, socket, sys, threading, time, dataclasses
from pathlib import Path
import numpy as np
from bagel_grain.configs import load_shipped
from bagel_grain.pipeline import build_pipeline, family_transform, pipeline_stats
from bagel_grain.sources.records import Record
from bagel_grain.tokenizer import load_tokenizer

data, scratch = Path(sys.argv[1]), Path(sys.argv[2])
cfg = load_shipped("demo", data)
tokenizer = load_tokenizer(data / "tokenizer" / "tokenizer.json")
names = [g.name for g in cfg.groups]

def status(field, pid="self"):
  return int(next(l for l in open(f"/proc/{pid}/status") if l.startswith(field)).split()[1]) * 1024

def measured(step):
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  before, start = status("VmRSS:"), time.perf_counter()
  try:
    outcome = step()
  except Exception as e:
    outcome = f"{type(e).__name__}: {str(e)[:160]}"
  print(json.dumps({"outcome": outcome, "seconds": round(time.perf_counter() - start, 3),
                    "peak_growth_mib": round((status("VmHWM:") - before) / 2**20, 1)}))

def one_record(group, fields):
  transform = family_transform(cfg, names.index(group), tokenizer)
  record = Record(index=0, epoch=0, record_id="hostile#0", dataset=0, fields=fields)
  return lambda: str(getattr(transform.random_map(record, np.random.default_rng(0)), "reason",
                             "a sample"))

def vlm_line(image, text="What is it?"):
  return json.dumps({"image": image, "conversations": [
      {"from": "human", "value": "<image>" + text}, {"from": "gpt", "value": "ok"}]}).encode()
"""

CASES = {
    "vlm_text_5MB": "measured(one_record('vlm_sft', vlm_line('images/img_000.png', 'x' * 5_000_000)))",
    "vlm_text_50MB": "measured(one_record('vlm_sft', vlm_line('images/img_000.png', 'x' * 50_000_000)))",
    "t2i_caption_5MB": (
        "import io\nfrom PIL import Image\nb = io.BytesIO(); Image.new('RGB', (64, 64)).save(b, 'PNG')\n"
        "measured(one_record('t2i_pretrain', {'image': b.getvalue(), "
        "'captions': json.dumps({'a': 'x' * 5_000_000})}))"),
    "t2i_caption_50MB": (
        "import io\nfrom PIL import Image\nb = io.BytesIO(); Image.new('RGB', (64, 64)).save(b, 'PNG')\n"
        "measured(one_record('t2i_pretrain', {'image': b.getvalue(), "
        "'captions': json.dumps({'a': 'x' * 50_000_000})}))"),
    "image_file_2GiB_sparse": (
        "f = open(data / 'vlm' / 'images' / 'hostile_huge.png', 'wb'); f.truncate(2 << 30); f.close()\n"
        "try:\n  measured(one_record('vlm_sft', vlm_line('images/hostile_huge.png')))\n"
        "finally:\n  os.remove(data / 'vlm' / 'images' / 'hostile_huge.png')"),
    "fifo_image": (
        "os.mkfifo(data / 'vlm' / 'images' / 'hostile_fifo.png')\n"
        "try:\n  measured(one_record('vlm_sft', vlm_line('images/hostile_fifo.png')))\n"
        "finally:\n  os.remove(data / 'vlm' / 'images' / 'hostile_fifo.png')"),
    "socket_image": (
        "s = socket.socket(socket.AF_UNIX); s.bind(str(data / 'vlm' / 'images' / 'hostile_sock.png'))\n"
        "try:\n  measured(one_record('vlm_sft', vlm_line('images/hostile_sock.png')))\n"
        "finally:\n  os.remove(data / 'vlm' / 'images' / 'hostile_sock.png')"),
    "device_image": (
        "os.mknod(data / 'vlm' / 'images' / 'hostile_zero.png', 0o600 | 0o020000, os.makedev(1, 5))\n"
        "try:\n  measured(one_record('vlm_sft', vlm_line('images/hostile_zero.png')))\n"
        "finally:\n  os.remove(data / 'vlm' / 'images' / 'hostile_zero.png')"),
    "stalled_read_timeout_2s": (
        "from bagel_grain.families.files import DiskFiles\n"
        "release = threading.Event()\nDiskFiles.read = lambda self, path: release.wait()\n"
        "it = iter(build_pipeline(dataclasses.replace(cfg, element_timeout_s=2), tokenizer, "
        "batch_size=1, workers=0))\n"
        "measured(lambda: next(it))\nrelease.set(); it.close()"),
    "state_with_100k_buffer_keys": (
        "it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=0)); next(it)\n"
        "state = it.get_state()\n"
        "shard = next(iter(state['shards'].values()))\n"
        "shard['packer']['buffer'] = [[0, 0]] * 100_000\n"
        "measured(lambda: it.set_state(state))\nit.close()"),
}


def _pipeline_case(workers: int) -> str:
  """A FIFO named by one VLM line, through one epoch of the whole pipeline."""
  return (
      "import shutil\ncopy = scratch / 'demo'\nshutil.copytree(data, copy)\n"
      "os.mkfifo(copy / 'vlm' / 'images' / 'hostile_fifo.png')\n"
      "with open(copy / 'vlm' / 'sft.jsonl', 'ab') as f:\n  f.write(vlm_line('images/hostile_fifo.png') + b'\\n')\n"
      "cfg = dataclasses.replace(load_shipped('demo', copy), num_epochs=1)\n"
      f"it = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers={workers}))\n"
      "def epoch():\n  for _ in it:\n    pass\n"
      "  return str(pipeline_stats(it)['drops']['vlm_sft'])\n"
      "measured(epoch)\nit.close()")


_BIG_ROW_GROUPS = """
import io, json, sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from PIL import Image
folder, mib = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
pngs = []
for _ in range(16):
  b = io.BytesIO()
  Image.fromarray(rng.integers(0, 256, (600, 600, 3), np.uint8)).save(b, 'PNG', compress_level=0)
  pngs.append(b.getvalue())
rows = mib * 2**20 // len(pngs[0])
for f in range(3):
  table = pa.table({'image': [pngs[i % 16] for i in range(rows)],
                    'captions': [json.dumps({'a': f'noise {f} {i}'}) for i in range(rows)]})
  pq.write_table(table, f'{folder}/part-{f:05d}.parquet', row_group_size=rows,
                 use_dictionary=False, compression='none')
print(rows)
"""


def _big_row_group_case(workers: int, row_group_mib: int) -> str:
  """The T2I group as three parquet files of one row group each (noise PNGs of about
  1 MiB, written by another process): the peak RSS of the main process and of each
  worker after 30 and after 120 batches (flat: the second equals the first)."""
  return (
      "import shutil, subprocess, psutil, yaml\n"
      "copy = scratch / 'demo'\nshutil.copytree(data, copy)\nshutil.rmtree(copy / 't2i')\n"
      "(copy / 't2i').mkdir()\n"
      f"rows = int(subprocess.run([sys.executable, '-c', {_BIG_ROW_GROUPS!r}, str(copy / 't2i'), "
      f"'{row_group_mib}'], check=True, capture_output=True, text=True).stdout)\n"
      "info = yaml.safe_load((copy / 'dataset_info.yaml').read_text())\n"
      "info['t2i_pretrain']['demo_t2i'].update(num_files=3, num_total_samples=3 * rows)\n"
      "(copy / 'dataset_info.yaml').write_text(yaml.safe_dump(info))\n"
      "cfg = load_shipped('demo', copy)\n"
      "def peaks():\n"
      f"  it = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers={workers}))\n"
      "  seen = []\n"
      "  for until in (30, 120):\n"
      "    while pipeline_stats(it)['rows'] < 2 * until:\n      next(it)\n"
      "    seen.append([status('VmHWM:', p) // 2**20 for p in ['self'] + "
      "[c.pid for c in psutil.Process().children()]])\n"
      "  it.close()\n"
      "  return f'peak MiB (main, workers...) at 30 batches {seen[0]}, at 120 {seen[1]}'\n"
      "measured(peaks)")


_FAKE_GS = (  # a `gs` first on PATH that records every call: no record may start it
    "gs_log = scratch / 'gs_calls.log'\n"
    "(scratch / 'gs').write_text(f'#!/bin/sh\\necho \"gs $*\" >> {gs_log}\\nexit 1\\n')\n"
    "(scratch / 'gs').chmod(0o755)\n"
    "os.environ['PATH'] = f'{scratch}:{os.environ[\"PATH\"]}'\n"
    "def with_gs_calls(step):\n"
    "  def run():\n"
    "    outcome = step()\n"
    "    calls = gs_log.read_text().count('gs ') if gs_log.exists() else 0\n"
    "    return f'{outcome}; gs calls: {calls}'\n"
    "  return run\n")
_EPS = ("eps = (b'%!PS-Adobe-3.0 EPSF-3.0\\n%%BoundingBox: 0 0 10 10\\n%%EndComments\\n'\n"
        "       b'newpath 0 0 moveto 10 10 lineto stroke showpage\\n%%EOF\\n')\n")
_SCAN_BOMB = (  # a progressive 8000x8000 JPEG, its last scan repeated 1000 times
    "import io\nfrom PIL import Image\nb = io.BytesIO()\n"
    "Image.new('RGB', (8000, 8000), (120, 60, 30)).save(b, 'JPEG', progressive=True)\n"
    "jpeg = b.getvalue()\nlast = jpeg.rfind(b'\\xff\\xda')\n"
    "bomb = jpeg[:last] + jpeg[last:-2] * 1001 + b'\\xff\\xd9'\n")
_WRITE_BIG_CELL = """
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
small = open(sys.argv[2], 'rb').read()
pq.write_table(pa.table({'image': [small, bytes(300_000_000), small, small],
                         'captions': [json.dumps({'a': 'x'})] * 4}), sys.argv[1],
               compression='zstd')
"""
_BIG_CELL = (  # a 300 MB image cell (zeros) among 3 small ones, in a zstd parquet file
    # written by another process, so that none of its memory is this one's
    "import subprocess\n"
    "from bagel_grain.sources.parquet import ParquetRowSource\n"
    "from bagel_grain.sources.records import ConcatSource, ShuffledRecords\n"
    "path = str(scratch / 'cell.parquet')\n"
    f"subprocess.run([sys.executable, '-c', {_WRITE_BIG_CELL!r}, path, "
    "str(data / 'vlm' / 'images' / 'img_000.jpg')], check=True)\n"
    "print('file bytes', os.path.getsize(path), file=sys.stderr)\n"
    "def read_all():\n"
    "  source = ParquetRowSource([path], ['image', 'captions'], max_cell_bytes=cfg.max_image_bytes)\n"
    "  records = ShuffledRecords(ConcatSource([source]), seed=0)\n"
    "  transform = family_transform(cfg, names.index('t2i_pretrain'), tokenizer)\n"
    "  outs = [transform.random_map(records[i], np.random.default_rng(0)) for i in range(4)]\n"
    "  return (f\"{[str(getattr(o, 'reason', 'sample')) for o in outs]}, cache held \"\n"
    "          f\"{source._cache.held_bytes} bytes\")\n")
CASES.update({
    "eps_in_t2i_row_fake_gs": _FAKE_GS + _EPS + (
        "measured(with_gs_calls(one_record('t2i_pretrain', "
        "{'image': eps, 'captions': json.dumps({'a': 'x'})})))"),
    "eps_in_vlm_line_fake_gs": _FAKE_GS + _EPS + (
        "(data / 'vlm' / 'images' / 'hostile_eps.png').write_bytes(eps)\n"
        "try:\n  measured(with_gs_calls(one_record('vlm_sft', vlm_line('images/hostile_eps.png'))))\n"
        "finally:\n  os.remove(data / 'vlm' / 'images' / 'hostile_eps.png')"),
    "ico_16x16_holding_8000x8000_png": (
        "import io, struct\nfrom PIL import Image\nb = io.BytesIO()\n"
        "Image.new('RGB', (8000, 8000), (1, 2, 3)).save(b, 'PNG')\npng = b.getvalue()\n"
        "ico = struct.pack('<HHH', 0, 1, 1) + struct.pack('<BBBBHHII', 16, 16, 0, 0, 1, 32, "
        "len(png), 22) + png\n"
        "cfg = dataclasses.replace(cfg, max_decode_pixels=10**6)\n"
        "measured(one_record('t2i_pretrain', {'image': ico, 'captions': json.dumps({'a': 'x'})}))"),
    "jpeg_8000x8000_1000_repeated_scans": _SCAN_BOMB + (
        "print('bomb bytes', len(bomb), file=sys.stderr)\n"
        "measured(one_record('t2i_pretrain', {'image': bomb, 'captions': json.dumps({'a': 'x'})}))"),
    "vlm_line_10000_images": (
        "line = json.dumps({'image': ['images/img_000.jpg'] * 10_000, 'conversations': [\n"
        "    {'from': 'human', 'value': '<image>' * 10_000 + 'Count.'},\n"
        "    {'from': 'gpt', 'value': 'Many.'}]}).encode()\n"
        "from PIL import Image\ndecodes = []\nreal = Image._getdecoder\n"
        "Image._getdecoder = lambda *a: decodes.append(a[1]) or real(*a)\n"
        "step = one_record('vlm_sft', line)\n"
        "measured(lambda: f'{step()}; decodes: {len(decodes)}')"),
    "parquet_300MB_cell_in_zstd_file": _BIG_CELL + "measured(read_all)",
})


CASES["fifo_in_pipeline_0_workers"] = _pipeline_case(0)
CASES["fifo_in_pipeline_2_workers"] = _pipeline_case(2)
CASES["parquet_3x153MiB_row_groups_0_workers"] = _big_row_group_case(0, 153)
CASES["parquet_3x153MiB_row_groups_2_workers"] = _big_row_group_case(2, 153)
CASES["parquet_3x1GiB_row_groups_2_workers"] = _big_row_group_case(2, 1024)


def run(case: str, code: str, data: str, timeout: float) -> dict:
  script = _PRELUDE + code
  with tempfile.TemporaryDirectory(prefix="hostile_") as scratch:
    path = Path(scratch) / "case.py"
    path.write_text("if __name__ == '__main__':\n" + "".join(
        f"  {line}\n" for line in script.splitlines()))
    try:
      out = subprocess.run([sys.executable, str(path), data, scratch], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return {"case": case, "outcome": f"no outcome after {timeout:g} s (hangs)"}
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  if not lines:
    return {"case": case, "outcome": "no report: " + out.stderr.strip()[-300:]}
  return {"case": case, **json.loads(lines[-1])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", required=True, help="the demo data folder")
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
  args = parser.parse_args(argv)
  results = []
  for case in args.cases:
    result = run(case, CASES[case], str(Path(args.data).resolve()), args.timeout)
    results.append(result)
    print(f"{case:30s} {result.get('outcome')!s:60.60s} {result.get('seconds', '-')!s:>8} s "
          f"{result.get('peak_growth_mib', '-')!s:>8} MiB", flush=True)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
