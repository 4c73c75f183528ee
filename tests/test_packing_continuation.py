"""Restoring onto a changed stream: data rewritten or removed is refused by name; the changes
of a new stage of training (weights, groups added or removed at the end, records appended)
continue exactly when asked to (`allow_changes`), every record of the epoch packed once."""

import collections
import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import hypothesis
import jax.numpy as jnp
import pyarrow.parquet as pq
import pytest
from hypothesis import strategies as st

from bagel_grain import build_pipeline
from bagel_grain.configs import load_shipped
from bagel_grain.errors import StateMismatchError
from bagel_grain.jax import checkpoint_manager, restore, save
from bagel_grain.packing import shares
from bagel_grain.packing.shards import merge_states
from bagel_grain.sources import sidecar
from bagel_grain.tooling.cli import NoProgress
from bagel_grain.workers import fetcher
from resume import assert_same_elements, take

TOOLS = Path(__file__).resolve().parents[1] / "tools"
RECORDS = {"t2i_pretrain": 76, "unified_edit": 30, "vlm_sft": 60}  # the demo data's epoch


@pytest.fixture
def data(demo_dir, tmp_path):
  """A copy of the demo data this test may change."""
  return shutil.copytree(demo_dir, tmp_path / "demo")


def config(data, *, groups=None, weights=None, logical_shards=None, num_epochs=1):
  """The demo config on `data`, `num_epochs`; `groups` (names, in this order) and `weights`
  (name -> weight)."""
  cfg = load_shipped("demo", data)
  named = {g.name: g for g in cfg.groups}
  chosen = [named[name] for name in groups] if groups is not None else list(cfg.groups)
  chosen = [dataclasses.replace(g, weight=(weights or {}).get(g.name, g.weight)) for g in chosen]
  return dataclasses.replace(cfg, groups=tuple(chosen), num_epochs=num_epochs,
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


def saved_then_appended(cfg, data, tokenizer):
  """A state (and its file lists) after 3 batches, then 6 lines appended to the JSONL."""
  with pipeline(cfg, tokenizer) as it:
    take(it, 3)
    saved = json.loads(json.dumps(it.get_state())), it.manifests()
  append_lines(data, 6)
  return saved


def by_epoch(batches):
  """(group, epoch, record) of every sample in `batches`, counted."""
  return collections.Counter((k[0], k[2], k[3]) for b in batches for row in b["sample_keys"]
                             for k in row)


def assert_each_epoch_exact(counts, originals, appended, num_epochs, starts):
  """In each epoch every original record of a group packed once; an appended one once an
  epoch from the epoch its logical shard took it in on (`starts[group]`: the first and the
  last such epoch of the shards), never before; nothing else, nothing twice."""
  assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]
  for group, records in originals.items():
    first, last = starts.get(group, (num_epochs, num_epochs))
    new = appended.get(group, set())
    for epoch in range(num_epochs):
      got = {r for g, e, r in counts if g == group and e == epoch}
      assert got - new == records, (group, epoch, len(got - new), len(records))
      if epoch < first:
        assert not got & new, (group, epoch)
      if epoch >= last:
        assert got & new == new, (group, epoch, len(got & new), len(new))
    for record in new:  # from its shard's first epoch on, in every one
      epochs = sorted(e for g, e, r in counts if g == group and r == record)
      assert epochs == list(range(num_epochs - len(epochs), num_epochs)), (record, epochs)


def every_record(cfg, tokenizer):
  """Per group, the records of one epoch (a fresh stream of the config, one epoch)."""
  with pipeline(dataclasses.replace(cfg, num_epochs=1), tokenizer) as it:
    seen = packed(list(it))
  out = collections.defaultdict(set)
  for group, record in seen:
    out[group].add(record)
  return dict(out)


def test_lines_appended_to_a_jsonl_need_the_saved_file_lists_and_allow_changes(
    data, demo_tokenizer):
  cfg = config(data)
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    for allow in (False, True):  # which lines are new takes the file lists a checkpoint keeps
      with pytest.raises(StateMismatchError,
                         match=r"group 'vlm_sft', dataset 'demo_vlm' under "
                               r".*/vlm: sft.jsonl: bytes \d+ -> \d+; blocks 60 -> 66.*"
                               r"restore through bagel_grain.jax.restore, or pass "
                               r"`saved_manifests`"):
        it.set_state(state, allow_changes=allow)
    with pytest.raises(StateMismatchError, match=r"dataset 'demo_vlm' under .*/vlm: records "
                                                 r"appended \(sft.jsonl: 6 lines appended\)"
                                                 r".*allow_changes=True"):
      it.set_state(state, saved_manifests=manifests)
    assert it.get_state()["shards"]["0"]["rows"] == 0  # where it was


@pytest.mark.parametrize("workers", [0, 2])
def test_lines_appended_to_a_jsonl_join_from_the_next_epoch(data, demo_tokenizer, workers):
  cfg = config(data, num_epochs=2)
  originals = every_record(cfg, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    before = take(it, 3)
    state, manifests = json.loads(json.dumps(it.get_state())), it.manifests()
  assert {e for g, e, _ in by_epoch(before) if g == "vlm_sft"} == {0}  # in its first epoch
  append_lines(data, 6)
  grown = every_record(cfg, demo_tokenizer)["vlm_sft"]
  with iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=workers)) as it:
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
    after = list(it)
    saved = it.get_state()
  assert saved["version"] == 4 and saved["shards"]["0"]["eras"] == {"vlm_sft": [1]}
  assert list(saved["data_eras"]) == ["vlm_sft"]
  appended = grown - originals["vlm_sft"]
  assert len(appended) == 6
  assert_each_epoch_exact(by_epoch(before) + by_epoch(after), originals,
                          {"vlm_sft": appended}, 2, {"vlm_sft": (1, 1)})


def test_a_closed_stream_starts_no_fetcher_at_a_restore_over_records_appended(
    data, demo_tokenizer):
  """The rows rebuilt over the record sets would start a fetcher (its workers, its thread)
  that nothing closes any more: refused, as a closed iterator's next() is."""
  cfg = config(data, num_epochs=2)
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  it = pipeline(cfg, demo_tokenizer)
  it.close()
  assert not fetcher.live()
  with pytest.raises(ValueError, match="closed"):
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
  assert not fetcher.live()


def test_a_state_taken_while_a_restore_rebuilds_the_rows_is_the_one_before_or_after(
    data, demo_tokenizer):
  """get_state from another thread reads the rows, their record sets and the position
  together: a restore over records appended swapping them meanwhile (here, while the old
  rows write their part) must not give the old position with the new record sets."""
  cfg = config(data, num_epochs=2)
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    take(it, 1)
    before, swapped, reading = it.get_state(), threading.Event(), threading.Event()
    old_rows, state_of = it._rows, it._rows.state_of  # pylint: disable=protected-access

    def slow_state_of(position):  # the reader's part of the old rows, finished after the swap
      if threading.current_thread() is reader:
        reading.set()
        swapped.wait(60)
      return state_of(position)

    old_rows.state_of = slow_state_of
    got = []
    reader = threading.Thread(target=lambda: got.append(it.get_state()))
    reader.start()
    assert reading.wait(60)
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
    swapped.set()
    reader.join(60)
    after = it.get_state()
  assert after != before and after["version"] == 4
  assert got[0] in (before, after)


def test_a_restore_over_records_appended_whose_old_rows_fail_to_close_is_still_restored(
    data, demo_tokenizer):
  """The old rows are closed once the new ones hold the restored position: an error there
  (a worker's pipe, say) is raised, and the stream is the one restored, not the new rows'
  beginning (which would pack again what the state had packed)."""
  cfg = config(data, num_epochs=2)
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
    want = it.get_state()
  with pipeline(cfg, demo_tokenizer) as it:
    old_rows, close = it._rows, it._rows.close  # pylint: disable=protected-access

    def failing_close():  # once: a later close (at garbage collection) is quiet
      close()
      old_rows.close = close
      raise OSError("a worker's pipe broke")

    old_rows.close = failing_close
    with pytest.raises(OSError, match="pipe broke"):
      it.set_state(state, allow_changes=True, saved_manifests=manifests)
    assert it.get_state() == want


def test_a_parquet_file_added_is_named_and_joins_across_a_resize(data, demo_tokenizer,
                                                                 tmp_path):
  """Saved by one process over 4 logical shards, restored by two through a checkpoint; the
  added file sorts before the others."""
  cfg = config(data, logical_shards=4, num_epochs=3)
  originals = every_record(cfg, demo_tokenizer)
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with pipeline(cfg, demo_tokenizer) as it:
    before = take(it, 5)
    save(manager, 5, {"w": jnp.zeros(2)}, it)
  shutil.copy(data / "t2i" / "part-00001.parquet", data / "t2i" / "aaa.parquet")
  appended = every_record(cfg, demo_tokenizer)["t2i_pretrain"] - originals["t2i_pretrain"]
  assert appended and all(r.startswith("demo_t2i/aaa.parquet#") for r in appended)
  after, states = collections.Counter(), []
  for p in range(2):
    with iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, process_index=p,
                             process_count=2, workers=0)) as it:
      with pytest.raises(StateMismatchError, match=r"dataset 'demo_t2i' under .*/t2i: records "
                                                   r"appended \(aaa.parquet added\)"):
        restore(manager, None, {"w": jnp.zeros(2)}, it)
      restore(manager, None, {"w": jnp.zeros(2)}, it, allow_changes=True)
      states.append(it.get_state())
      after += by_epoch(list(it))
  counts = by_epoch(before) + after
  starts = {int(s): e["eras"]["t2i_pretrain"][0] for st in states
            for s, e in st["shards"].items()}
  assert set(starts) == {0, 1, 2, 3} and all(1 <= e <= 2 for e in starts.values())
  # Each shard finished its epoch over the records it started with; the file's records
  # joined from its next epoch: once per epoch from the first epoch every shard has them.
  assert_each_epoch_exact(counts, originals, {"t2i_pretrain": appended}, 3,
                          {"t2i_pretrain": (min(starts.values()), max(starts.values()))})


def test_a_stream_with_records_appended_saves_and_restores_through_a_checkpoint(
    data, demo_tokenizer, tmp_path):
  """After the restore that took the appended lines in, a checkpoint keeps the earlier
  record set's files (data_eras.json): a later restore continues exactly; a bare state
  without them is refused, saying what to pass."""
  cfg = config(data, num_epochs=2)
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with pipeline(cfg, demo_tokenizer) as it:
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
    take(it, 2)
    save(manager, 2, {"w": jnp.zeros(2)}, it)
    later = json.loads(json.dumps(it.get_state()))
    uninterrupted = take(it, 4)
  kept = json.loads((tmp_path / "checkpoints" / "2" / "data" / "data_eras.json").read_text())
  assert list(kept) == ["vlm_sft"] and kept["vlm_sft"][0]["demo_vlm"]["blocks"] == 60
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"records were appended to group 'vlm_sft'.*"
                                                 r"pass `saved_manifests` \(and `saved_eras`\)"):
      it.set_state(later)
    restore(manager, 2, {"w": jnp.zeros(2)}, it)  # the same data now: nothing to allow
    assert it.get_state() == later
    assert [b["sample_keys"] for b in take(it, 4)] == [b["sample_keys"] for b in uninterrupted]


@pytest.mark.parametrize("damage, named", [
    (lambda s: s["shards"]["0"].pop("eras"),
     r"state field `shards.0.eras.vlm_sft`: expected a list"),
    (lambda s: s["shards"]["0"]["eras"].update(vlm_sft=[1, 2]), r"expected 1 entries, got 2"),
    (lambda s: s["shards"]["0"]["eras"].update(vlm_sft=["1"]), r"expected a whole number"),
    (lambda s: s["data_eras"].update(nope=[]), r"`data_eras`: no group 'nope'"),
], ids=["eras_missing", "eras_too_many", "eras_not_a_number", "unknown_group"])
def test_a_malformed_record_set_schedule_is_named_and_changes_nothing(data, demo_tokenizer,
                                                                      damage, named):
  cfg = config(data, num_epochs=2)
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
    saved, eras = json.loads(json.dumps(it.get_state())), it.era_manifests()
  damage(saved)
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=named):
      it.set_state(saved, saved_eras=eras)
    assert it.get_state()["shards"]["0"]["rows"] == 0 and "data_eras" not in it.get_state()


def with_video(cfg, data):
  """`cfg` with the demo's video dataset added to the vlm group."""
  from bagel_grain.config import DatasetSpec  # pylint: disable=import-outside-toplevel
  video = DatasetSpec("demo_video", str(data / "video"),
                      jsonl_path=str(data / "video" / "video.jsonl"))
  groups = [dataclasses.replace(g, datasets=(*g.datasets, video)) if g.name == "vlm_sft"
            else g for g in cfg.groups]
  return dataclasses.replace(cfg, groups=tuple(groups))


def test_a_dataset_added_to_a_group_joins_from_the_next_epoch(data, demo_tokenizer):
  cfg = config(data, num_epochs=2)
  originals = every_record(cfg, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    before = take(it, 3)
    state, manifests = json.loads(json.dumps(it.get_state())), it.manifests()
  stage_2 = with_video(cfg, data)
  appended = every_record(stage_2, demo_tokenizer)["vlm_sft"] - originals["vlm_sft"]
  assert len(appended) == 4 and all(r.startswith("demo_video/") for r in appended)
  with pipeline(stage_2, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"dataset 'demo_video'.*records appended "
                                                 r"\(dataset added\).*allow_changes=True"):
      it.set_state(state, saved_manifests=manifests)
    it.set_state(state, allow_changes=True, saved_manifests=manifests)
    after = list(it)
  assert_each_epoch_exact(by_epoch(before) + by_epoch(after), originals,
                          {"vlm_sft": appended}, 2, {"vlm_sft": (1, 1)})


def rewrite_first_line(data):
  path = data / "vlm" / "sft.jsonl"
  lines = path.read_bytes().splitlines(keepends=True)
  path.write_bytes(b"".join([lines[1]] + lines[1:] + lines[:6]))


def edit_last_line(data):
  """The last line changed in place (same length), then lines appended."""
  path = data / "vlm" / "sft.jsonl"
  lines = path.read_bytes().splitlines(keepends=True)
  last = lines[-1].replace(b"a", b"b", 1)
  assert last != lines[-1] and len(last) == len(lines[-1])
  path.write_bytes(b"".join(lines[:-1] + [last] + lines[:6]))


@pytest.mark.parametrize("change, named", [
    (lambda d: (d / "t2i" / "part-00001.parquet").unlink(), r"part-00001.parquet removed"),
    (lambda d: shutil.copy(d / "t2i" / "part-00000.parquet", d / "t2i" / "part-00001.parquet"),
     r"part-00001.parquet changed size"),
    (lambda d: (d / "vlm" / "sft.jsonl").write_bytes(
        b"".join((d / "vlm" / "sft.jsonl").read_bytes().splitlines(keepends=True)[:50])),
     r"sft.jsonl changed size \(\d+ -> \d+ bytes\); blocks .* 60 -> 50"),
    (rewrite_first_line, r"sft.jsonl changed in its first 60 lines"),
    (edit_last_line, r"sft.jsonl changed in its first 60 lines"),
], ids=["parquet_deleted", "parquet_rewritten", "jsonl_shrunk", "jsonl_rewritten_and_grown",
        "jsonl_tail_edited_and_grown"])
def test_records_removed_or_rewritten_are_refused_even_when_allowed(data, demo_tokenizer, change,
                                                                    named):
  cfg = config(data, num_epochs=2)
  with pipeline(cfg, demo_tokenizer) as it:
    take(it, 3)
    state, manifests = json.loads(json.dumps(it.get_state())), it.manifests()
  change(data)
  with pipeline(cfg, demo_tokenizer) as it:
    first = next(it)
    with pytest.raises(StateMismatchError, match=named):
      it.set_state(state, allow_changes=True, saved_manifests=manifests)
    assert it.get_state()["shards"]["0"]["rows"] == 2  # where it was
    assert next(it)["sample_keys"] != first["sample_keys"]  # and goes on from there


def _patch_byte(path, offset):
  """One byte of the file changed in place: its size is the same."""
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("target, offset", [("t2i/part-00000.parquet", 100),
                                            ("vlm/sft.jsonl", 10)])
@pytest.mark.parametrize("allow", [False, True])
def test_an_indexed_file_rewritten_at_its_size_is_refused_by_name(data, demo_tokenizer, target,
                                                                  offset, allow):
  cfg = config(data, num_epochs=2)
  sidecar.index_config(cfg, NoProgress)
  with pipeline(cfg, demo_tokenizer) as it:
    take(it, 3)
    state, manifests = json.loads(json.dumps(it.get_state())), it.manifests()
  _patch_byte(data / target, offset)  # a byte a probe may not see: the data indexed again
  sidecar.index_config(cfg, NoProgress)
  name = target.split("/")[1]
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=rf"{name} rewritten \(its content checksum"):
      it.set_state(state, allow_changes=allow, saved_manifests=manifests)
    with pytest.raises(StateMismatchError, match="file contents"):  # without the file lists
      it.set_state(state, allow_changes=allow)



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
                                                 r"\(shard_state_0-of-2.json from \{.*\"run\": "
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


def run_stage(cfg, tokenizer, processes, rows, saved):
  """Each of `processes` simulated processes restores `saved` (None: a fresh start; else
  the merged state and the file lists a checkpoint keeps) with allow_changes and packs
  `rows` rows (None: to the end); their samples by epoch, and what they saved."""
  samples, states = collections.Counter(), []
  for p in range(processes):
    with iter(build_pipeline(cfg, tokenizer, batch_size=1, process_index=p,
                             process_count=processes, workers=0)) as it:
      if saved is not None:
        state, manifests, eras = saved
        it.set_state(state, allow_changes=True, saved_manifests=manifests, saved_eras=eras)
      samples += by_epoch(take(it, rows) if rows is not None else list(it))
      states.append(json.loads(json.dumps(it.get_state())))
      kept = it.manifests(), it.era_manifests()
  return samples, (merge_states(states), *kept)


def appended_record(record):
  """Whether `record` is one the schedule below appended (a parquet file `extra-*`, lines
  past the JSONL's 60th)."""
  name, _, line = record.rpartition(":")
  return "/extra-" in record or (name == "demo_vlm/sft.jsonl" and int(line) > 60)


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(stages=st.lists(st.tuples(
    st.sampled_from([1, 2, 4]),  # processes of the stage
    st.integers(1, 3),  # rows per process before the next save
    st.sampled_from(["weights", "add_group", "remove_group", "append", "rewrite", "none"])),
    min_size=1, max_size=3))
# Appends at two restores in a row (the first set kept across a save and a restore).
@hypothesis.example(stages=[(1, 2, "add_group"), (2, 2, "append"), (4, 1, "append")])
@hypothesis.example(stages=[(2, 3, "append"), (1, 1, "append"), (4, 1, "remove_group")])
def test_stages_of_training_pack_every_record_once_an_epoch(demo_dir, demo_tokenizer,
                                                            tmp_path_factory, stages):
  """Random schedules over two epochs: run, save, change weights, the groups at the end,
  the process count or the data (records appended, or a file rewritten), restore with
  allow_changes. A group that stays to the end packs each record it started with once an
  epoch, and each appended one once an epoch from its shard's next epoch on; nothing is
  packed twice in an epoch; a file rewritten is refused by name."""
  data = shutil.copytree(demo_dir, tmp_path_factory.mktemp("stages") / "demo")
  groups, weights = GROUPS[:2], {}
  saved, total, ever_removed = None, collections.Counter(), set()
  appends = collections.defaultdict(list)  # per group, the records of each append
  for n, (processes, rows, change) in enumerate(stages):
    cfg = config(data, groups=groups, weights=weights, logical_shards=4, num_epochs=2)
    samples, saved = run_stage(cfg, demo_tokenizer, processes, rows, saved)
    total += samples
    if change == "weights":
      weights = {g: float(1 + (len(total) + i) % 5) for i, g in enumerate(groups)}
    elif change == "add_group" and len(groups) < 3 and GROUPS[len(groups)] not in ever_removed:
      groups = GROUPS[:len(groups) + 1]  # (a group added again would start anew)
    elif change == "remove_group" and len(groups) > 1:
      ever_removed.add(groups[-1])
      groups = groups[:-1]
    elif change == "append" and "vlm_sft" in groups:
      first = 61 + 3 * len(appends["vlm_sft"])
      append_lines(data, 3)
      appends["vlm_sft"].append({f"demo_vlm/sft.jsonl:{i}" for i in range(first, first + 3)})
    elif change == "append":
      shutil.copy(data / "t2i" / f"part-0000{n % 2}.parquet", data / "t2i" / f"extra-{n}.parquet")
      rows_in = pq.ParquetFile(data / "t2i" / f"extra-{n}.parquet").metadata.num_rows
      appends["t2i_pretrain"].append({f"demo_t2i/extra-{n}.parquet#{i}" for i in range(rows_in)})
    elif change == "rewrite":  # refused even when allowed, naming the file; then put back
      original = (data / "t2i" / "part-00001.parquet").read_bytes()
      shutil.copy(data / "t2i" / "part-00000.parquet", data / "t2i" / "part-00001.parquet")
      cfg = config(data, groups=groups, weights=weights, logical_shards=4, num_epochs=2)
      with pytest.raises(StateMismatchError, match=r"part-00001.parquet changed size"):
        run_stage(cfg, demo_tokenizer, 1, 1, saved)
      (data / "t2i" / "part-00001.parquet").write_bytes(original)
  cfg = config(data, groups=groups, weights=weights, logical_shards=4, num_epochs=2)
  samples, (state, _, _) = run_stage(cfg, demo_tokenizer, 2, None, saved)
  total += samples
  assert all(n == 1 for n in total.values()), [k for k, n in total.items() if n > 1]
  for g in groups:
    if g in ever_removed:
      continue
    for epoch in (0, 1):
      kept = [r for group, e, r in total if group == g and e == epoch and not appended_record(r)]
      assert len(kept) == RECORDS[g], (g, epoch, len(kept))
  for g, record in {(g, r) for g, _, r in total if appended_record(r)}:
    assert sorted(e for group, e, r in total if (group, r) == (g, record)) in ([1], [0, 1])
  for g, records in appends.items():  # each shard takes them from the epoch its state says
    for k, added in enumerate(records):
      if g in groups and all(e["eras"][g][k] <= 1 for e in state["shards"].values()):
        assert added <= {r for group, e, r in total if group == g and e == 1}, (g, k)


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


def test_weights_scaled_alike_restore_as_the_same_stream(data, demo_tokenizer):
  tenths = config(data, weights={"t2i_pretrain": 0.5, "unified_edit": 0.2, "vlm_sft": 0.3})
  whole = config(data, weights={"t2i_pretrain": 5.0, "unified_edit": 2.0, "vlm_sft": 3.0})
  before, state = saved_after(tenths, demo_tokenizer, 3)
  with pipeline(tenths, demo_tokenizer) as it:
    it.set_state(state)
    want = list(it)
  with pipeline(whole, demo_tokenizer) as it:
    it.set_state(state)  # no allow_changes: the same shares are the same stream
    got = list(it)
  assert_same_elements(got, want)
  counts = packed(before) + packed(got)
  assert all(n == 1 for n in counts.values()) and sum(counts.values()) == sum(RECORDS.values())


def test_weights_whose_shares_round_apart_are_still_named(data, demo_tokenizer):
  _, state = saved_after(config(data, weights={"t2i_pretrain": 1.0, "unified_edit": 1.0,
                                               "vlm_sft": 1.0}), demo_tokenizer, 1)
  # 0.3 + 0.3 + 0.3 is not 3 * 0.3 in floats: one draw's bound differs in its last bit.
  with pipeline(config(data, weights={"t2i_pretrain": 0.3, "unified_edit": 0.3,
                                      "vlm_sft": 0.3}), demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"t2i_pretrain.weight: saved 1.0, now 0.3"):
      it.set_state(state)


@pytest.mark.parametrize("saved, ours, same", [
  ([5, 2, 3], [0.5, 0.2, 0.3], True),
  ([1, 1, 1], [2, 2, 2], True),
  ([1, 0, 1], [4, 0, 4], True),
  ([1, 1, 1], [0.3, 0.3, 0.3], False),  # the set of all three rounds apart
  ([1, 0, 1], [1, 1, 1], False),
  ([2, 1], [1, 2], False),
])
def test_same_draws_compares_the_draws_cumulative_shares(saved, ours, same):
  assert shares.same_draws(saved, ours) is same


def test_records_appended_to_a_dataset_read_with_num_used_data_name_it(data, demo_tokenizer):
  cfg = config(data)
  vlm = cfg.group("vlm_sft")
  used = dataclasses.replace(vlm, datasets=tuple(dataclasses.replace(d, num_used_data=10)
                                                 for d in vlm.datasets))
  cfg = dataclasses.replace(cfg, groups=tuple(used if g.name == "vlm_sft" else g
                                              for g in cfg.groups))
  state, manifests = saved_then_appended(cfg, data, demo_tokenizer)
  with pipeline(cfg, demo_tokenizer) as it:
    with pytest.raises(StateMismatchError, match=r"sft.jsonl changed size .*reads `num_used_data` "
                                                 r"\(10\) of its records.*even with "
                                                 "allow_changes=True"):
      it.set_state(state, allow_changes=True, saved_manifests=manifests)
