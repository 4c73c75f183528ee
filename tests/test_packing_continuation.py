"""Restoring onto a changed stream: data that changed is refused by name; the changes of a
new stage of training (weights, groups added or removed at the end) continue exactly when
asked to (`allow_changes`), every record of the epoch packed once."""

import collections
import dataclasses
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import hypothesis
import jax.numpy as jnp
import pytest
from hypothesis import strategies as st

from bagel_grain import build_pipeline
from bagel_grain.configs import load_shipped
from bagel_grain.errors import StateMismatchError
from bagel_grain.jax import checkpoint_manager, restore, save
from bagel_grain.packing.shards import merge_states
from resume import take

TOOLS = Path(__file__).resolve().parents[1] / "tools"
RECORDS = {"t2i_pretrain": 76, "unified_edit": 30, "vlm_sft": 60}  # the demo data's epoch


@pytest.fixture
def data(demo_dir, tmp_path):
  """A copy of the demo data this test may change."""
  return shutil.copytree(demo_dir, tmp_path / "demo")


def config(data, *, groups=None, weights=None, logical_shards=None):
  """The demo config on `data`, one epoch; `groups` (names, in this order) and `weights`
  (name -> weight)."""
  cfg = load_shipped("demo", data)
  named = {g.name: g for g in cfg.groups}
  chosen = [named[name] for name in groups] if groups is not None else list(cfg.groups)
  chosen = [dataclasses.replace(g, weight=(weights or {}).get(g.name, g.weight)) for g in chosen]
  return dataclasses.replace(cfg, groups=tuple(chosen), num_epochs=1,
                             logical_shards=logical_shards)


def pipeline(cfg, tokenizer, **kwargs):
  return iter(build_pipeline(cfg, tokenizer, batch_size=2, workers=0, **kwargs))


def packed(batches):
  """(group, record) of every sample in `batches`, counted."""
  return collections.Counter((k[0], k[3]) for b in batches for row in b["sample_keys"]
                             for k in row)


def saved_after(cfg, tokenizer, batches):
  with pipeline(cfg, tokenizer) as it:
    before = take(it, batches)
    return before, json.loads(json.dumps(it.get_state()))


def append_lines(data, n):
  path = data / "vlm" / "sft.jsonl"
  lines = path.read_bytes().splitlines(keepends=True)
  path.write_bytes(b"".join(lines + lines[:n]))


def test_lines_appended_to_a_jsonl_are_refused_naming_the_dataset(data, demo_tokenizer):
  cfg = config(data)
  _, state = saved_after(cfg, demo_tokenizer, 3)
  append_lines(data, 6)
  with pipeline(cfg, demo_tokenizer) as it:
    for allow in (False, True):  # changed data is refused in either mode
      with pytest.raises(StateMismatchError,
                         match=r"group 'vlm_sft', dataset 'demo_vlm' under "
                               r".*/vlm: sft.jsonl: bytes \d+ -> \d+; blocks 60 -> 66"):
        it.set_state(state, allow_changes=allow)
    assert it.get_state()["shards"]["0"]["rows"] == 0  # where it was


def test_a_parquet_file_added_is_refused_and_the_checkpoint_names_it(data, demo_tokenizer,
                                                                      tmp_path):
  cfg = config(data)
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with pipeline(cfg, demo_tokenizer) as it:
    take(it, 3)
    save(manager, 3, {"w": jnp.zeros(2)}, it)
  shutil.copy(data / "t2i" / "part-00000.parquet", data / "t2i" / "part-00009.parquet")
  with pipeline(config(data), demo_tokenizer) as it:
    with pytest.raises(StateMismatchError,
                       match=r"dataset 'demo_t2i' under .*/t2i: part-00009.parquet added"):
      restore(manager, None, {"w": jnp.zeros(2)}, it)


def step_2_with_a_file_of_step_1(cfg, tokenizer, tmp_path, name):
  """A checkpoint of steps 1 and 2 whose step 2 holds step 1's shard file `name`."""
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with pipeline(cfg, tokenizer) as it:
    for step in (1, 2):
      take(it, 2)
      save(manager, step, {"w": jnp.zeros(2)}, it)
  steps = tmp_path / "checkpoints"
  shutil.copy(steps / "1" / "data" / name, steps / "2" / "data" / name)
  return manager


def test_a_step_holding_a_shard_file_of_another_save_is_refused(data, demo_tokenizer, tmp_path):
  cfg = config(data, logical_shards=2)
  manager = step_2_with_a_file_of_step_1(cfg, demo_tokenizer, tmp_path, "shard_state_1-of-2.json")
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"mixes shard files of different saves "
                                                 r"\(shard_state_0-of-2.json from \{\"run\": "
                                                 r".*\"step\": 2\}; shard_state_1-of-2.json "
                                                 r"from \{.*\"step\": 1\}\)"):
      restore(manager, 2, {"w": jnp.zeros(2)}, it)


def test_a_step_holding_the_one_shard_file_of_another_step_is_refused(data, demo_tokenizer,
                                                                      tmp_path):
  cfg = config(data)  # one shard, read by the one process: nothing to compare it with
  manager = step_2_with_a_file_of_step_1(cfg, demo_tokenizer, tmp_path, "shard_state_0-of-1.json")
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match="saved at step 1, not at step 2 being restored"):
      restore(manager, 2, {"w": jnp.zeros(2)}, it)
    assert it.get_state()["shards"]["0"]["rows"] == 0  # where it was


def test_a_shard_file_that_is_not_of_the_states_shard_count_is_refused(data, demo_tokenizer,
                                                                       tmp_path):
  cfg = config(data, logical_shards=2)
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with pipeline(cfg, demo_tokenizer) as it:
    take(it, 2)
    save(manager, 1, {"w": jnp.zeros(2)}, it)
  folder = tmp_path / "checkpoints" / "1" / "data"
  shutil.copy(folder / "shard_state_1-of-2.json", folder / "shard_state_5-of-2.json")
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"files of no such shard: "
                                                 r"\['shard_state_5-of-2.json'\]"):
      restore(manager, 1, {"w": jnp.zeros(2)}, it)


def test_a_weight_change_is_named_and_continues_exactly_when_allowed(data, demo_tokenizer):
  before, state = saved_after(config(data), demo_tokenizer, 1)
  stage_2 = config(data, weights={"unified_edit": 8.0})
  with pipeline(stage_2, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"grouped_datasets.unified_edit.weight: saved "
                                                 r"1.0, now 8.0.*allow_changes=True"):
      it.set_state(state)
    it.set_state(state, allow_changes=True)
    after = list(it)
  counts = packed(before) + packed(after)
  assert all(n == 1 for n in counts.values())  # nothing packed twice
  assert collections.Counter(g for g, _ in counts) == RECORDS  # nor missed
  # The new weights draw: unified_edit (not mandatory) takes more of what follows.
  with pipeline(config(data), demo_tokenizer) as it:
    it.set_state(state)
    unchanged = list(it)
  assert first_samples(after, 20)["unified_edit"] > first_samples(unchanged, 20)["unified_edit"]


def first_samples(batches, n):
  """The groups of the first `n` samples of `batches`, counted."""
  groups = [k[0] for b in batches for row in b["sample_keys"] for k in row]
  return collections.Counter(groups[:n])


def test_a_group_added_at_the_end_starts_at_its_first_epoch(data, demo_tokenizer):
  before, state = saved_after(config(data, groups=["t2i_pretrain", "unified_edit"]),
                              demo_tokenizer, 4)
  with pipeline(config(data), demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match="group 'vlm_sft' added"):
      it.set_state(state)
    it.set_state(state, allow_changes=True)
    after = list(it)
  assert not any(g == "vlm_sft" for g, _ in packed(before))
  counts = packed(before) + packed(after)
  assert all(n == 1 for n in counts.values())
  assert collections.Counter(g for g, _ in counts) == RECORDS


def test_the_last_group_removed_leaves_with_a_warning_counting_its_waiting_samples(
    data, demo_tokenizer, caplog):
  def edit_waiting(state):
    packer = state["shards"]["0"]["packer"]
    return sum(k != [-1, -1] and k[0] == 2 for k in packer["buffer"] + packer["carried"])

  # unified_edit last, so that it may leave; saved where some of its samples wait.
  order = ["t2i_pretrain", "vlm_sft", "unified_edit"]
  before, state = saved_after(config(data, groups=order), demo_tokenizer, 3)
  waiting = edit_waiting(state)
  assert waiting > 0
  with pipeline(config(data, groups=order[:2]), demo_tokenizer) as it:
    with caplog.at_level(logging.WARNING, logger="bagel_grain.packing.continuation"):
      it.set_state(state, allow_changes=True)
    after = list(it)
  assert [r.getMessage() for r in caplog.records if r.name.endswith("continuation")] == [
      f"group 'unified_edit' left the stream at this restore (allow_changes): {waiting} of its "
      "samples waiting in the packer's buffer are not packed"]
  counts = packed(before) + packed(after)
  assert all(n == 1 for n in counts.values())
  by_group = collections.Counter(g for g, _ in counts)
  assert by_group["t2i_pretrain"] == 76 and by_group["vlm_sft"] == 60
  assert not any(g == "unified_edit" for g, _ in packed(after))


def test_a_group_removed_from_the_middle_is_refused_even_when_allowed(data, demo_tokenizer):
  _, state = saved_after(config(data), demo_tokenizer, 2)
  with pipeline(config(data, groups=["t2i_pretrain", "vlm_sft"]), demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match="groups are matched by position"):
      it.set_state(state, allow_changes=True)


def test_the_same_data_elsewhere_is_the_same_stream(data, demo_tokenizer, tmp_path):
  cfg = config(data)
  before, state = saved_after(cfg, demo_tokenizer, 3)
  moved = shutil.copytree(data, tmp_path / "moved")
  shutil.rmtree(data)
  with pipeline(config(moved), demo_tokenizer) as it:
    it.set_state(state)
    after = list(it)
  counts = packed(before) + packed(after)
  assert all(n == 1 for n in counts.values()) and sum(counts.values()) == sum(RECORDS.values())


GROUPS = ["t2i_pretrain", "unified_edit", "vlm_sft"]


def run_stage(cfg, tokenizer, processes, rows, state, allow):
  """Each of `processes` simulated processes restores `state` (None: a fresh start) and packs
  `rows` rows (None: to the end); their samples and their states, merged."""
  samples, states = collections.Counter(), []
  for p in range(processes):
    with iter(build_pipeline(cfg, tokenizer, batch_size=1, process_index=p,
                             process_count=processes, workers=0)) as it:
      if state is not None:
        it.set_state(state, allow_changes=allow)
      samples += packed(take(it, rows) if rows is not None else list(it))
      states.append(json.loads(json.dumps(it.get_state())))
  return samples, merge_states(states)


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(stages=st.lists(st.tuples(
    st.sampled_from([1, 2, 4]),  # processes of the stage
    st.integers(1, 3),  # rows per process before the next save
    st.sampled_from(["weights", "add_group", "remove_group", "none"])), min_size=1, max_size=3))
def test_stages_of_training_pack_every_record_at_most_once_and_the_kept_groups_exactly_once(
    demo_dir, demo_tokenizer, stages):
  """Random schedules: run, save, change weights or the groups at the end and the process
  count, restore with allow_changes. A group that stays to the end packs each record of
  its epoch once; nothing is ever packed twice."""
  groups, weights = GROUPS[:2], {}
  state, total, ever_removed = None, collections.Counter(), set()
  for processes, rows, change in stages:
    cfg = config(demo_dir, groups=groups, weights=weights, logical_shards=4)
    samples, state = run_stage(cfg, demo_tokenizer, processes, rows, state, allow=True)
    total += samples
    if change == "weights":
      weights = {g: float(1 + (len(total) + i) % 5) for i, g in enumerate(groups)}
    elif change == "add_group" and len(groups) < 3 and GROUPS[len(groups)] not in ever_removed:
      groups = GROUPS[:len(groups) + 1]  # (a group added again would start anew)
    elif change == "remove_group" and len(groups) > 1:
      ever_removed.add(groups[-1])
      groups = groups[:-1]
  cfg = config(demo_dir, groups=groups, weights=weights, logical_shards=4)
  samples, _ = run_stage(cfg, demo_tokenizer, 2, None, state, allow=True)
  total += samples
  assert all(n == 1 for n in total.values()), [k for k, n in total.items() if n > 1]
  by_group = collections.Counter(g for g, _ in total)
  for g in groups:
    if g not in ever_removed:
      assert by_group[g] == RECORDS[g], (g, by_group)


def test_the_stage_schedule_example_runs_and_packs_each_record_once(demo_dir):
  done = subprocess.run([sys.executable, str(TOOLS / "stage_schedule.py"), "--data",
                         str(demo_dir), "--steps", "2"], capture_output=True, text=True,
                        timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "every record of the epoch packed once: yes" in done.stdout


def test_a_dataset_named_with_dots_is_named_whole(data, demo_tokenizer):
  def dotted(cfg):
    vlm = cfg.groups[2]
    renamed = dataclasses.replace(vlm, datasets=(dataclasses.replace(vlm.datasets[0],
                                                                     name="llava_v1.5"),))
    return dataclasses.replace(cfg, groups=(*cfg.groups[:2], renamed))

  _, state = saved_after(dotted(config(data)), demo_tokenizer, 2)
  append_lines(data, 3)
  with pipeline(dotted(config(data)), demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"dataset 'llava_v1.5' under .*: sft.jsonl: "
                                                 r"bytes \d+ -> \d+; blocks 60 -> 63"):
      it.set_state(state)


def test_the_same_jsonl_named_relatively_or_absolutely_is_the_same_manifest(data, monkeypatch):
  from bagel_grain.config import DatasetSpec
  from bagel_grain.sources.manifest import dataset_manifest
  monkeypatch.chdir(data)

  class Lines:  # what the manifest asks of a source
    def num_blocks(self):
      return 60

  relative = DatasetSpec("d", "vlm", jsonl_path="vlm/sft.jsonl")
  absolute = DatasetSpec("d", str(data / "vlm"), jsonl_path=str(data / "vlm" / "sft.jsonl"))
  assert (dataset_manifest(relative, "jsonl", Lines()).files
          == dataset_manifest(absolute, "jsonl", Lines()).files == (("sft.jsonl", (
              data / "vlm" / "sft.jsonl").stat().st_size),))
