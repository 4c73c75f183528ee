"""`bagel-grain convert` killed and run again, moved, and bounded: a run killed anywhere
resumes to a clean run's bytes, leaves no partial file, and a converted folder stands
alone (issues 27 and 29)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bagel_grain.config import load_config
from bagel_grain.errors import DatasetError
from bagel_grain.sources import framing
from bagel_grain.tooling import convert
from test_convert import write_config

KILLER = Path(__file__).parent / "killed_convert.py"


def tree_bytes(root: Path) -> dict[str, bytes]:
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
          if p.is_file()}


def shard_stats(root: Path) -> dict[str, tuple[int, int]]:
  return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
          for p in root.rglob("*.array_record")}


def partials(root: Path) -> list[Path]:
  return [p for p in root.rglob("*") if ".partial-" in p.name]


def run(config, out, **kwargs):
  return convert.convert_config_file(config, out, records_per_shard=16, num_threads=2,
                                     progress=False, **kwargs)


def kill_convert(config, out, where: str, n: int) -> None:
  done = subprocess.run([sys.executable, str(KILLER), str(config), str(out), where, str(n)],
                        capture_output=True, text=True, timeout=300, check=False,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert done.returncode == -9, done.stderr[-2000:]


@pytest.fixture(scope="module")
def clean(demo_dir, tmp_path_factory):
  """(config, {path: bytes} of a conversion never killed)."""
  tmp = tmp_path_factory.mktemp("clean")
  config = write_config(demo_dir, tmp)
  run(config, tmp / "out")
  written = tree_bytes(tmp / "out")
  assert sum(name.endswith(".array_record") for name in written) == 8 + 2 + 4
  return config, written


# Mid-shard (records 5 and 133: in the first t2i shard, in the edit dataset's first), and
# between shards (after 1 and after 11 of 14 shards).
@pytest.mark.parametrize("where,n", [("record", 5), ("record", 133), ("shard", 1),
                                     ("shard", 11)])
def test_a_killed_run_resumes_to_a_clean_runs_bytes(clean, tmp_path, where, n):
  config, expected = clean
  out = tmp_path / "out"
  kill_convert(config, out, where, n)
  finished = shard_stats(out)
  assert not (out / "config.yaml").exists() and not (out / "dataset_info.yaml").exists()
  assert len(finished) == (n // 16 if where == "record" and n < 116 else
                           8 + (n - 116) // 16 if where == "record" else n)
  if where == "record":
    assert partials(out)  # what the kill left mid-shard
  run(config, out)  # the same command again
  assert tree_bytes(out) == expected
  assert not partials(out)
  kept = shard_stats(out)
  assert all(kept[name] == stat for name, stat in finished.items())  # not written again


def test_a_shard_whose_records_are_not_the_planned_ones_is_written_again(clean, tmp_path):
  config, expected = clean
  out = tmp_path / "out"
  kill_convert(config, out, "shard", 11)
  t2i = sorted((out / "t2i_pretrain" / "demo_t2i").glob("*.array_record"))
  shutil.copyfile(t2i[0], t2i[1])  # a whole ArrayRecord file, 16 records: other ones
  data = t2i[2].read_bytes()
  t2i[2].write_bytes(data[:len(data) // 2])  # cut short
  t2i[3].write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one bit flipped
  before = shard_stats(out)
  run(config, out)
  assert tree_bytes(out) == expected
  after = shard_stats(out)
  rewritten = {name for name in before if after[name] != before[name]}
  assert rewritten == {str(p.relative_to(out)) for p in t2i[1:4]}


@pytest.mark.parametrize("overwrite", [False, True])
def test_no_partial_file_survives_a_finished_run(clean, tmp_path, overwrite):
  config, expected = clean
  out = tmp_path / "out"
  run(config, out)
  stray = out / "vlm_sft" / "demo_vlm" / f"demo_vlm-00001-of-00004{convert.SUFFIX}.partial-0123"
  stray.write_bytes(b"left by a run killed mid-shard")
  run(config, out, overwrite=overwrite)
  assert tree_bytes(out) == expected and not partials(out)


def test_overwrite_killed_midway_leaves_no_config_to_load(clean, tmp_path, monkeypatch):
  config, _ = clean
  out = tmp_path / "out"
  run(config, out)
  real = convert.write_shard
  calls = [0]

  def failing(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 5:
      raise KeyboardInterrupt  # the run stopped after 4 of 14 new shards
    return real(*args, **kwargs)
  monkeypatch.setattr(convert, "write_shard", failing)
  with pytest.raises(KeyboardInterrupt):
    run(config, out, overwrite=True)
  assert not (out / "config.yaml").exists() and not (out / "dataset_info.yaml").exists()


def test_a_folder_whose_count_differs_from_its_shards_is_refused_by_name(clean, tmp_path):
  config, expected = clean
  out = tmp_path / "out"
  done = run(config, out)
  cfg = load_config(done.config)
  g = cfg.group("vlm_sft")
  assert len(g.family.source(g, g.datasets[0])) == 50
  next((out / "vlm_sft" / "demo_vlm").glob("*.array_record")).unlink()
  with pytest.raises(DatasetError, match=r"hold 34 records.*num_total_samples: 50") as e:
    g.family.source(g, g.datasets[0])
  assert "demo_vlm" in str(e.value)
  with pytest.raises(DatasetError, match="does not write"):  # another plan's shards
    convert.convert_config_file(config, out, records_per_shard=20, progress=False)


def test_a_converted_corpus_stands_alone(demo_dir, tmp_path):
  converted = []
  for copy in ("a", "b"):
    data = tmp_path / copy / "data"
    shutil.copytree(demo_dir, data, ignore=shutil.ignore_patterns("tokenizer"))
    raw = yaml.safe_load(write_config(demo_dir, tmp_path / copy).read_text())
    raw["dataset_info"] = "data/dataset_info.yaml"
    (tmp_path / copy / "groups.yaml").write_text(yaml.safe_dump(raw["grouped_datasets"]))
    raw["grouped_datasets"] = "groups.yaml"  # a file beside the config
    config = tmp_path / copy / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    run(config, tmp_path / copy / "out")
    converted.append(tree_bytes(tmp_path / copy / "out"))
  assert converted[0] == converted[1]  # shards, dataset_info and config: the same bytes
  shutil.rmtree(tmp_path / "a" / "data")
  os.remove(tmp_path / "a" / "groups.yaml")
  cfg = load_config(tmp_path / "a" / "out" / "config.yaml")
  g = cfg.group("vlm_sft")
  source = g.family.source(g, g.datasets[0])
  assert len(source) == 50 and source[0].line
  shard = next((tmp_path / "a" / "out" / "vlm_sft").rglob("*-00000-of-*"))
  from array_record.python import array_record_module
  reader = array_record_module.ArrayRecordReader(str(shard))
  origins = [framing.origin(r) for r in reader.read(0, 3)]
  reader.close()
  assert all(o.startswith("demo_vlm/sft.jsonl:") for o in origins), origins


def test_a_line_over_the_text_bound_is_not_converted_and_is_counted(demo_dir, tmp_path,
                                                                     demo_tokenizer, capsys):
  raw = yaml.safe_load(write_config(demo_dir, tmp_path).read_text())
  raw["max_num_tokens_per_sample"] = 600
  bound = 600 * demo_tokenizer.longest_token_chars
  shutil.copytree(demo_dir, tmp_path / "data", ignore=shutil.ignore_patterns("tokenizer"))
  data = tmp_path / "data" / "vlm"
  lines = (data / "sft.jsonl").read_bytes().splitlines()
  for name in os.listdir(data):
    if ".bagel_" in name:
      os.remove(data / name)  # the index of the file before the long line
  huge = json.dumps({"conversations": [{"from": "human", "value": "x" * (bound + 1)},
                                       {"from": "gpt", "value": "y"}]}).encode()
  (data / "sft.jsonl").write_bytes(b"\n".join(lines[:3] + [huge] + lines[3:]) + b"\n")
  raw.update(dataset_info=str(tmp_path / "data" / "dataset_info.yaml"))
  raw["grouped_datasets"]["vlm_sft"]["num_used_data"] = [len(lines) + 1]
  raw["grouped_datasets"]["vlm_sft"]["shuffle_lines"] = False
  config = tmp_path / "config.yaml"
  config.write_text(yaml.safe_dump(raw))
  from bagel_grain.tooling.cli import main
  assert main(["convert", "--config", str(config), "--out", str(tmp_path / "out"),
               "--records-per-shard", "16"]) == 0
  said = (f"vlm_sft/demo_vlm: {len(lines)} records in {-(-(len(lines) + 1) // 16)} ArrayRecord "
          "files; 1 lines longer than the text bound not converted")
  assert said in capsys.readouterr().out
  assert main(["convert", "--config", str(config), "--out", str(tmp_path / "out"),
               "--records-per-shard", "16"]) == 0  # again: every shard verified and kept
  assert said in capsys.readouterr().out
  cfg = load_config(tmp_path / "out" / "config.yaml")
  g = cfg.group("vlm_sft")
  source = g.family.source(g, g.datasets[0])
  assert [source[i].line for i in range(len(source))] == lines  # all but the long one
  assert "1 lines longer than the text bound" in (tmp_path / "out" / "dataset_info.yaml"
                                                 ).read_text()


def test_shards_in_a_bucket_are_verified_and_kept(clean, monkeypatch):
  from object_store import LocalObjectStore  # the tests' local S3 server
  from bagel_grain import fs
  config, expected = clean
  with LocalObjectStore("s3") as store:
    for name, value in store.environment().items():
      monkeypatch.setenv(name, value)
    out = store.uri("converted")
    run(config, out)
    damaged = f"{out}/unified_edit/demo_edit/demo_edit-00001-of-00002.array_record"
    fs.write_bytes(damaged, fs.read_bytes(damaged)[:-5000])  # cut short
    uploads = []
    real = fs.upload_file
    monkeypatch.setattr(fs, "upload_file", lambda local, p: uploads.append(p) or real(local, p))
    run(config, out)  # the same command: the damaged shard only is written again
    assert uploads == [damaged]
    for name, data in expected.items():
      assert fs.read_bytes(f"{out}/{name}") == data, name


def test_the_checked_count_leaves_the_fingerprints_of_old_states_as_they_were(clean,
                                                                              tmp_path):
  from bagel_grain import pipeline
  config, _ = clean
  cfg = load_config(run(config, tmp_path / "out").config)
  assert cfg.group("vlm_sft").datasets[0].num_records == 50
  for g in cfg.groups:  # states of versions 1 and 2 hashed each dataset's fields as they were
    assert all(set(d) == {"name", "data_dir", "jsonl_path", "parquet_info_path",
                          "num_used_data", "array_record_path"}
               for d in pipeline._group_fields(g)["datasets"])  # pylint: disable=protected-access
