"""The data ledger and the replay tell exactly which samples the training loop took at
each step: over a run of 60 steps checkpointed every 10, with 0 and 2 workers, on 2
real JAX processes with 4 logical shards, killed between saves, restored onto 1
process, and continued on a new stage (docs/debugging.md)."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

from bagel_grain import build_pipeline, load_config, load_tokenizer
from bagel_grain import jax as bgj
from bagel_grain.errors import StateMismatchError
from bagel_grain.ledger import LedgerError, open_ledger
from bagel_grain.tooling import bench, cli
from bagel_grain.tooling.replay import replay
from jax_cluster import run_processes, small_demo_config

WORKER = Path(__file__).resolve().parent / "ledger_worker.py"
STEPS, EVERY = 60, 10


def keys_by_row(table) -> dict[tuple[int, int], list[tuple]]:
  """A ledger table as {(process, row): [(group, index, epoch, record), ...]}."""
  out = collections.defaultdict(list)
  for line in table.to_pylist():
    out[(line["process"], line["row"])].append(
        (line["group"], line["index"], line["epoch"], line["record"]))
  return dict(out)


def replayed_by_row(batches) -> dict[tuple[int, int], list[tuple]]:
  return {(b.process, r): [tuple(k) for k in keys]
          for b in batches for r, keys in enumerate(b.batch["sample_keys"]) if keys}


def steps_of(truth: dict[int, dict], record: str) -> list[tuple[int, int, int]]:
  return sorted((step, p, r) for step, rows in truth.items() for (p, r), keys in rows.items()
                for k in keys if k[3] == record)


# -- one process, in this test process: 0 and 2 workers ---------------------------------


def train(cfg, tokenizer, ckpt: Path, *, workers: int, stop: int = STEPS, start: int = -1,
          allow_changes: bool = False) -> dict[int, dict]:
  """Takes batches to `stop`, saving every 10 steps; {step: {(0, row): keys}}."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  host = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers=workers))
  data = bgj.device_iterator(host, mesh, ledger=ckpt / "data_ledger")
  manager = bgj.checkpoint_manager(str(ckpt))
  taken = {}
  try:
    if start >= 0:
      bgj.restore(manager, start, {"w": jnp.zeros(2)}, data, allow_changes=allow_changes)
    while data.batches_taken < stop:
      step = data.batches_taken
      taken[step] = {(0, r): [tuple(k) for k in keys]
                     for r, keys in enumerate(next(data).sample_keys)}
      if data.batches_taken % EVERY == 0:
        bgj.save(manager, data.batches_taken, {"w": jnp.zeros(2)}, data)
  finally:
    data.close()
    manager.close()
  return taken


@pytest.fixture(scope="module")
def small_config(demo_dir, tmp_path_factory):
  path = small_demo_config(demo_dir, tmp_path_factory.mktemp("ledger") / "config.yaml")
  cfg = load_config(path)
  return cfg, load_tokenizer(cfg.tokenizer_path)


@pytest.fixture(scope="module", params=[0, 2], ids=["0_workers", "2_workers"])
def one_process_run(request, small_config, tmp_path_factory):
  cfg, tokenizer = small_config
  ckpt = tmp_path_factory.mktemp(f"run_{request.param}") / "ckpt"
  return request.param, ckpt, train(cfg, tokenizer, ckpt, workers=request.param)


def test_ledger_and_replay_give_the_keys_each_step_took(one_process_run, small_config):
  workers, ckpt, truth = one_process_run
  cfg, tokenizer = small_config
  ledger = open_ledger(ckpt)
  for step in range(STEPS):
    assert keys_by_row(ledger.at_step(step)) == truth[step], step
  assert not ledger.at_step(STEPS).num_rows  # taken after the last save: never trained
  for step in random.Random(workers).sample(range(STEPS), 2):
    assert replayed_by_row(replay(cfg, tokenizer, ckpt, step, workers=workers)) == truth[step]


def test_record_query_gives_exactly_the_steps(one_process_run):
  workers, ckpt, truth = one_process_run
  ledger = open_ledger(ckpt)
  records = sorted({k[3] for rows in truth.values() for keys in rows.values() for k in keys})
  for record in random.Random(workers).sample(records, 5):
    table = ledger.of_record(record)
    assert sorted(zip(table["step"].to_pylist(), table["process"].to_pylist(),
                      table["row"].to_pylist())) == steps_of(truth, record)


def test_stats_count_what_was_trained(one_process_run):
  _, ckpt, truth = one_process_run
  samples = collections.Counter(k[0] for rows in truth.values() for keys in rows.values()
                                for k in keys)
  stats = open_ledger(ckpt).stats()
  assert {g: s["samples"] for g, s in stats.items()} == samples
  epochs = collections.defaultdict(int)
  for rows in truth.values():
    for keys in rows.values():
      for k in keys:
        epochs[k[0]] = max(epochs[k[0]], k[2])
  assert {g: s["epoch"] for g, s in stats.items()} == epochs
  assert all(s["tokens"] > 0 for s in stats.values())


# -- a damaged or foreign ledger file is refused by name --------------------------------


def test_a_truncated_segment_is_refused_by_name(one_process_run, tmp_path):
  _, ckpt, _ = one_process_run
  copy = Path(shutil.copytree(ckpt / "data_ledger", tmp_path / "ledger"))
  segment = sorted(copy.glob("*steps000000000010-*.parquet"))[0]
  (copy / f".tmp-0badcafe-{segment.name}").write_bytes(b"PAR1")  # a write a kill cut short
  segment.write_bytes(segment.read_bytes()[:-100])
  ledger = open_ledger(copy)
  assert ledger.at_step(3).num_rows  # the other segments still answer
  with pytest.raises(LedgerError, match=f"{segment.name} is not a whole ledger file"):
    ledger.at_step(13)
  with pytest.raises(LedgerError, match=segment.name):
    ledger.stats()


def test_another_runs_segment_is_refused_by_name(small_config, one_process_run, tmp_path):
  cfg, tokenizer = small_config
  _, ckpt, _ = one_process_run
  other = train(cfg, tokenizer, tmp_path / "other", workers=0, stop=EVERY)
  assert other
  copy = Path(shutil.copytree(ckpt / "data_ledger", tmp_path / "ledger"))
  [foreign] = (tmp_path / "other" / "data_ledger").glob("*.parquet")
  shutil.copy(foreign, copy / foreign.name)  # replaces this run's segment of steps 0..9
  with pytest.raises(LedgerError, match=f"{foreign.name} belongs to run"):
    open_ledger(copy).at_step(4)
  (copy / foreign.name).unlink()
  marker = copy / "g000005-from000000000030.begin.json"  # another run's restore at 30
  marker.write_text(json.dumps({"run": "0badcafe", "generation": 5, "begins": 30}))
  with pytest.raises(LedgerError, match=f"{marker.name} belongs to run '0badcafe'"):
    open_ledger(copy)


def test_a_restore_supersedes_the_steps_after_it(small_config, demo_dir, tmp_path):
  """Saved at 10, 20, 30, killed at 35; step 30 lost (not committed): restored at 20 on
  a new stage. Steps 20..29 appear once, as trained after the restore."""
  cfg, tokenizer = small_config
  ckpt = tmp_path / "ckpt"
  first = train(cfg, tokenizer, ckpt, workers=0, stop=35)
  shutil.rmtree(ckpt / "30")
  changed = load_config(_reweighted(demo_dir, tmp_path))
  second = train(changed, tokenizer, ckpt, workers=0, stop=40, start=20, allow_changes=True)
  assert any(first[s] != second[s] for s in range(20, 30))  # the new stage took others
  ledger = open_ledger(ckpt)
  for step in range(40):
    assert keys_by_row(ledger.at_step(step)) == (first if step < 20 else second)[step], step
  assert replayed_by_row(replay(changed, tokenizer, ckpt, 25, allow_changes=True)) == \
      second[25]
  with pytest.raises(StateMismatchError, match="weight"):
    replay(changed, tokenizer, ckpt, 25)  # without --allow-changes: the fields named


def _reweighted(demo_dir: Path, out: Path) -> Path:
  path = small_demo_config(demo_dir, out / "stage2.yaml")
  raw = yaml.safe_load(path.read_text())
  raw["grouped_datasets"]["t2i_pretrain"]["weight"] = 4
  path.write_text(yaml.safe_dump(raw))
  return path


# -- real processes: 2 processes with 4 logical shards, killed, onto 1, a new stage -----


@pytest.fixture(scope="module")
def elastic_run(demo_dir, tmp_path_factory):
  """A: 2 processes from the start, saves 10..30, killed at 35. B: 1 process restores 30,
  saves 40, killed at 47. C: 2 processes, a new stage (weights), restore 40, to 60."""
  out = tmp_path_factory.mktemp("ledger_elastic")
  config = small_demo_config(demo_dir, out / "config.yaml", logical_shards=4)
  raw = yaml.safe_load(config.read_text())
  raw["grouped_datasets"]["t2i_pretrain"]["weight"] = 4
  stage = out / "stage2.yaml"
  stage.write_text(yaml.safe_dump(raw))
  run_processes(WORKER, 2, [config, out, "A", -1, 35])
  run_processes(WORKER, 1, [config, out, "B", 30, 47])
  run_processes(WORKER, 2, [stage, out, "C", 40, 60, "allow_changes"])
  phases = {}
  for name, processes in (("A", 2), ("B", 1), ("C", 2)):
    taken = collections.defaultdict(dict)
    for p in range(processes):
      for step, rows in json.loads((out / f"{name}_{p}.json").read_text()).items():
        taken[int(step)].update({(p, r): [tuple(k) for k in keys]
                                 for r, keys in enumerate(rows)})
    phases[name] = taken
  truth = {s: phases["A" if s < 30 else "B" if s < 40 else "C"][s] for s in range(STEPS)}
  return out, config, stage, truth


def test_ledger_agrees_with_what_was_trained_after_each_restore(elastic_run):
  out, _, _, truth = elastic_run
  ledger = open_ledger(out / "ckpt")
  for step in range(STEPS):
    assert keys_by_row(ledger.at_step(step)) == truth[step], step
  shards = ledger.at_step(5)["shard"].to_pylist() + ledger.at_step(55)["shard"].to_pylist()
  assert set(shards) == {0, 1, 2, 3}  # each row's logical shard is kept
  records = sorted({k[3] for rows in truth.values() for keys in rows.values() for k in keys})
  for record in random.Random(1).sample(records, 4):
    table = ledger.of_record(record)
    assert sorted(zip(table["step"].to_pylist(), table["process"].to_pylist(),
                      table["row"].to_pylist())) == steps_of(truth, record)


@pytest.mark.parametrize("lowest,stage", [(0, False), (30, False), (40, True), (50, True)])
def test_replay_from_any_checkpoint_of_the_elastic_run(elastic_run, lowest, stage):
  out, config, stage_config, truth = elastic_run
  cfg = load_config(stage_config if stage else config)
  step = random.Random(lowest).randrange(lowest, lowest + EVERY)
  got = replay(cfg, load_tokenizer(cfg.tokenizer_path), out / "ckpt", step,
               allow_changes=lowest == 40, workers=0)
  assert [b.processes for b in got] == ([1] if lowest == 30 else [2, 2])
  assert replayed_by_row(got) == truth[step]


def test_the_commands_print_a_step(elastic_run, capsys, tmp_path):
  out, config, _, truth = elastic_run
  assert cli.main(["ledger", str(out / "ckpt"), "--step", "12"]) == 0
  printed = capsys.readouterr().out
  assert all(k[3] in printed for keys in truth[12].values() for k in keys)
  assert cli.main(["replay", "--config", str(config), "--checkpoint", str(out / "ckpt"),
                   "--step", "12", "--process", "1", "--workers", "0",
                   "--png", str(tmp_path)]) == 0
  printed = capsys.readouterr().out
  assert "step 12, process 1 of 2 (from checkpoint step 10, 2 batches packed forward)" in printed
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      f"step12_process1_row{r}.png" for r in range(len(truth[12]) // 2)]
  assert all(k[3] in printed for (p, _), keys in truth[12].items() if p == 1 for k in keys)


def test_bench_reports_the_ledgers_cost_and_size(small_config):
  cfg, tokenizer = small_config
  report = bench.measure_ledger(cfg, tokenizer, batch_size=2, step_s=0.1, batches=3)
  assert report["samples_per_step"] > 2
  assert 0 < report["bytes_per_sample"] < 200
  assert report["bytes_per_1m_steps"] == pytest.approx(
      report["bytes_per_sample"] * report["samples_per_step"] * 1e6)
  # 512-token rows and a 3-step segment (its footer counts): far from the bench config's
  # 0.03% (docs/debugging.md), still a small share.
  assert 0 < report["share_of_token_bytes"] < 0.05
  assert "bytes/sample" in bench.ledger_line(report)


def test_the_ledger_command_imports_neither_grain_nor_jax(one_process_run):
  """Part of what keeps `--step` near a second at 1M steps: the command imports no
  pipeline (and reads only the segments holding the step: the truncated-segment test)."""
  _, ckpt, truth = one_process_run
  script = ("import sys; from bagel_grain.tooling import cli; "
            f"code = cli.main(['ledger', {str(ckpt)!r}, '--step', '7']); "
            "print(code, sorted(m for m in ('grain', 'jax', 'orbax') if m in sys.modules))")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                        timeout=120, check=True)
  assert done.stdout.splitlines()[-1] == "0 []"
  assert all(k[3] in done.stdout for keys in truth[7].values() for k in keys)
