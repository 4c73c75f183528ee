"""Each "file that lies" probe in a fresh process: the error or drop it now gives, its time, peak RSS.

Runs on the demo data (generated into a temporary folder unless `--data` names
one). Per probe it prints one JSON line: the probe's name, what came out (the
error's type and first words, or the drop counts), the seconds the probed call
took (imports and data set-up excluded) and the peak RSS of the process (and of
its children, for the worker probes) in MiB.

    python tools/files_that_lie.py
    python tools/files_that_lie.py --only footer_1e9 alias_bomb_image_stride
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = textwrap.dedent("""
    import json, os, resource, shutil, sys, time
    from pathlib import Path
    import yaml
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    demo, tmp = Path(sys.argv[2]), Path(sys.argv[3])
    CONFIGS = Path(sys.argv[1]) / "bagel_grain" / "configs"

    def demo_raw(**changes):
      raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
      raw.update(dataset_info=str(demo / "dataset_info.yaml"),
                 tokenizer_path=str(demo / "tokenizer"), **changes)
      return raw

    def copied_info(group, folder):
      # dataset_info with `group`'s data copied into tmp/folder, the rest on the demo data
      shutil.copytree(demo / folder, tmp / folder)
      info = yaml.safe_load((demo / "dataset_info.yaml").read_text())
      for name, g in info.items():
        for spec in g.values():
          for key in ("data_dir", "jsonl_path", "parquet_info_path"):
            if key in spec:
              spec[key] = str((tmp if name == group else demo) / spec[key])
      return info

    def report(outcome, seconds):
      self_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
      children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
      print(json.dumps({"outcome": outcome, "seconds": round(seconds, 3),
                        "peak_rss_mib": round(self_mib, 1),
                        "children_peak_rss_mib": round(children, 1)}))

    def timed(call):
      start = time.monotonic()
      try:
        value = call()
        outcome = "ok" if value is None else value
      except Exception as e:
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
      report(outcome, time.monotonic() - start)

    def drops_of(it, group, batches):
      from bagel_grain.pipeline import pipeline_stats
      try:
        for _ in range(batches):
          next(it)
        end = "ran"
      except StopIteration:
        end = "epoch ended"
      except Exception as e:
        end = f"{type(e).__name__}: {str(e)[:200]}"
      stats = pipeline_stats(it)
      it.close()
      return {"end": end, "drops": stats["drops"].get(group, {}),
              "counts": stats["counts"][group]}
""")

FOOTER = """
import pyarrow.parquet as pq, lying_parquet
from bagel_grain.sources.parquet import dataset_source
shutil.copytree(demo / "t2i", tmp / "t2i")
path = tmp / "t2i" / "zz_lie.parquet"
pq.write_table(pq.read_table(demo / "t2i" / "part-00000.parquet").slice(0, 4), path)
lying_parquet.claim_rows(path, 0, CLAIM, consistent=CONSISTENT)
timed(lambda: len(dataset_source(str(tmp / "t2i"), None, ["image", "captions"])))
"""

PIPELINE_REWRITTEN = """
import dataclasses
import pyarrow.parquet as pq
from bagel_grain.config import config_from_dict
from bagel_grain.pipeline import build_pipeline
from bagel_grain.tokenizer import load_tokenizer
raw = demo_raw(num_epochs=1, max_row_group_cache_bytes=0)
raw["dataset_info"] = copied_info("t2i_pretrain", "t2i")
cfg = config_from_dict(raw, file="demo.yaml", base_dir=str(CONFIGS))
tok = load_tokenizer(demo / "tokenizer" / "tokenizer.json")
it = iter(build_pipeline(cfg, tok, batch_size=1, workers=0))
next(it)
shard = tmp / "t2i" / "part-00000.parquet"
pq.write_table(pq.read_table(shard).slice(0, 2), shard)
timed(lambda: drops_of(it, "t2i_pretrain", 10**6))
"""

JSONL_DELETED = """
from absl import flags
flags.FLAGS.mark_as_parsed()
from bagel_grain.config import config_from_dict
from bagel_grain.pipeline import build_pipeline
from bagel_grain.tokenizer import load_tokenizer

def main():
  raw = demo_raw(num_epochs=None)
  raw["dataset_info"] = copied_info("vlm_sft", "vlm")
  cfg = config_from_dict(raw, file="demo.yaml", base_dir=str(CONFIGS))
  tok = load_tokenizer(demo / "tokenizer" / "tokenizer.json")
  it = iter(build_pipeline(cfg, tok, batch_size=1, workers=WORKERS))
  next(it)
  os.unlink(tmp / "vlm" / "sft.jsonl")
  timed(lambda: drops_of(it, "vlm_sft", 2000))

if __name__ == "__main__":
  main()
"""

CONFIG_FILE = """
from bagel_grain.config import config_from_dict, load_config
from fifos import fifo
"""

ALIAS_BOMB = CONFIG_FILE + """
raw = demo_raw()
marker = "BOMB_HERE"
if KEY == "max_num_tokens":
  raw["max_num_tokens"] = marker
elif KEY == "weight":
  raw["grouped_datasets"]["vlm_sft"]["weight"] = marker
else:
  raw["grouped_datasets"]["vlm_sft"]["image_transform_args"]["image_stride"] = marker
lines = ["  l0: &l0 [" + ", ".join(["1"] * 10) + "]"]
lines += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 10)]
text = "anchors:\\n" + "\\n".join(lines) + "\\n" + yaml.safe_dump(raw).replace(marker, "*l9")
(tmp / "bomb.yaml").write_text(text)
timed(lambda: load_config(tmp / "bomb.yaml"))
"""

PROBES = {
    "footer_1e7": FOOTER.replace("CLAIM", "10**7").replace("CONSISTENT", "False"),
    "footer_1e9": FOOTER.replace("CLAIM", "10**9").replace("CONSISTENT", "False"),
    "footer_1e9_consistent": FOOTER.replace("CLAIM", "10**9").replace("CONSISTENT", "True"),
    "parquet_rewritten_2_rows_mid_epoch": PIPELINE_REWRITTEN,
    "config_fifo": CONFIG_FILE + """
with fifo(tmp / "main.yaml"):
  timed(lambda: load_config(tmp / "main.yaml"))
""",
    "dataset_info_fifo": CONFIG_FILE + """
raw = demo_raw()
raw["dataset_info"] = str(tmp / "info.yaml")
with fifo(tmp / "info.yaml"):
  timed(lambda: config_from_dict(raw, file="demo.yaml", base_dir=str(CONFIGS)))
""",
    "alias_bomb_max_num_tokens": ALIAS_BOMB.replace("KEY", '"max_num_tokens"'),
    "alias_bomb_weight": ALIAS_BOMB.replace("KEY", '"weight"'),
    "alias_bomb_image_stride": ALIAS_BOMB.replace("KEY", '"image_stride"'),
    "weights_1e308": CONFIG_FILE + """
raw = demo_raw()
for g in raw["grouped_datasets"].values():
  g["weight"] = 1e308
timed(lambda: config_from_dict(raw, file="demo.yaml", base_dir=str(CONFIGS)))
""",
    "duplicated_group_key": CONFIG_FILE + """
text = yaml.safe_dump(demo_raw())
(tmp / "dup.yaml").write_text(text.replace("grouped_datasets:\\n", "grouped_datasets:\\n  vlm_sft: {}\\n", 1))
timed(lambda: load_config(tmp / "dup.yaml"))
""",
    "tokenizer_json_model_1": """
from bagel_grain.tokenizer import load_tokenizer
(tmp / "tok").mkdir()
(tmp / "tok" / "tokenizer.json").write_text('{"model": 1}')
timed(lambda: load_tokenizer(tmp / "tok"))
""",
    "tokenizer_fifo": """
from bagel_grain.tokenizer import load_tokenizer
from fifos import fifo
with fifo(tmp / "tokenizer.json"):
  timed(lambda: load_tokenizer(tmp / "tokenizer.json"))
""",
    "jsonl_deleted_mid_run_0_workers": JSONL_DELETED.replace("WORKERS", "0"),
    "jsonl_deleted_mid_run_2_workers": JSONL_DELETED.replace("WORKERS", "2"),
}


def run(name: str, data: Path, root: Path) -> dict:
  with tempfile.TemporaryDirectory(prefix="bagel_lies_") as tmp:
    script = Path(tmp) / f"{name}.py"
    script.write_text(PRELUDE + PROBES[name])
    (Path(tmp) / "work").mkdir()
    child = subprocess.run([sys.executable, str(script), str(root), str(data),
                            str(Path(tmp) / "work")], capture_output=True, text=True,
                           timeout=600, check=False)
  lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
  if child.returncode != 0 or not lines:
    return {"probe": name, "failed": child.stderr[-1500:]}
  return {"probe": name, **json.loads(lines[-1])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", help="an existing demo dataset (default: generate one)")
  parser.add_argument("--only", nargs="*", choices=sorted(PROBES))
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="bagel_lies_demo_") as tmp:
    data = Path(args.data) if args.data else None
    if data is None:
      from bagel_grain.tooling.demo_data import make_sample_data  # pylint: disable=import-outside-toplevel
      data = make_sample_data(Path(tmp) / "demo")
    for name in args.only or PROBES:
      print(json.dumps(run(name, data, ROOT)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
