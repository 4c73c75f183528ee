"""Orbax checkpoints of the data iterator: a damaged one names its file."""

import json
import shutil
from pathlib import Path

import grain
import jax.numpy as jnp
import pytest
from fifos import fifo

from bagel_grain import build_pipeline
from bagel_grain.errors import StateMismatchError
from bagel_grain.jax import checkpoint, checkpoint_manager, restore, save


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"version": 1}'])
def test_a_damaged_data_state_names_the_checkpoint_file(demo_config, demo_tokenizer, tmp_path,
                                                        damage):
  manager = checkpoint_manager(str(tmp_path / "checkpoints"))
  with iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)) as it:
    next(it)
    save(manager, 1, {"w": jnp.zeros(3)}, it)
  [data] = (tmp_path / "checkpoints" / "1" / "data").glob("shard_state_*.json")  # the one shard
  data.write_text(damage)
  with iter(build_pipeline(demo_config, demo_tokenizer, batch_size=1, workers=0)) as it:
    with pytest.raises(StateMismatchError, match=f"cannot restore the data iterator from {data}"):
      restore(manager, None, {"w": jnp.zeros(3)}, it)


def _saved_checkpoint(config, tokenizer, folder):
  """A checkpoint of step 1 in `folder` (one batch in); returns its manager and data/ folder."""
  manager = checkpoint_manager(str(folder))
  with iter(build_pipeline(config, tokenizer, batch_size=1, workers=0)) as it:
    next(it)
    save(manager, 1, {"w": jnp.zeros(3)}, it)
  return manager, Path(folder) / "1" / "data"


def _restore_into_new_iterator(manager, config, tokenizer):
  with iter(build_pipeline(config, tokenizer, batch_size=1, workers=0)) as it:
    restore(manager, None, {"w": jnp.zeros(3)}, it)


@pytest.mark.parametrize("name", ["shard_state_0-of-1.json", "data_manifest.json"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_unopened(demo_config, demo_tokenizer,
                                                                  tmp_path, name):
  manager, data = _saved_checkpoint(demo_config, demo_tokenizer, tmp_path / "ck")
  (data / name).unlink()
  with fifo(data / name) as rescued:
    with pytest.raises(StateMismatchError, match=f"{data / name} is not a regular file"):
      _restore_into_new_iterator(manager, demo_config, demo_tokenizer)
  assert not rescued  # never opened: no writer had to come


def test_a_huge_data_manifest_is_refused_before_it_is_read(demo_config, demo_tokenizer, tmp_path,
                                                            monkeypatch):
  manager, data = _saved_checkpoint(demo_config, demo_tokenizer, tmp_path / "ck")
  monkeypatch.setattr(checkpoint, "MIN_MANIFEST_BYTES", 1 << 16)  # a small file stands in
  (data / "data_manifest.json").write_text(json.dumps("x" * (1 << 20)))
  read = _count_reads(monkeypatch)
  with pytest.raises(StateMismatchError,
                     match=rf"data_manifest.json: {(1 << 20) + 2} bytes > \d+ \(a data manifest"):
    _restore_into_new_iterator(manager, demo_config, demo_tokenizer)
  assert not [p for p in read if p.endswith("data_manifest.json")]


def test_a_shard_state_with_a_huge_buffer_is_refused_before_it_is_parsed(
    demo_config, demo_tokenizer, tmp_path, monkeypatch):
  manager, data = _saved_checkpoint(demo_config, demo_tokenizer, tmp_path / "ck")
  shard = data / "shard_state_0-of-1.json"
  state = json.loads(shard.read_text())
  state["packer"]["buffer"] = [[0, 1]] * 200_000
  shard.write_text(json.dumps(state))
  parsed, real_loads = [], json.loads
  monkeypatch.setattr(json, "loads", lambda text, **kw: parsed.append(len(text))
                      or real_loads(text, **kw))
  with pytest.raises(StateMismatchError, match=r"shard_state_0-of-1.json: \d+ bytes > \d+ "
                                               r"\(a shard state"):
    _restore_into_new_iterator(manager, demo_config, demo_tokenizer)
  assert all(n < 1 << 20 for n in parsed)  # the big file was never parsed


def test_a_checkpoint_without_its_data_folder_names_the_folder(demo_config, demo_tokenizer,
                                                               tmp_path):
  manager, data = _saved_checkpoint(demo_config, demo_tokenizer, tmp_path / "ck")
  shutil.rmtree(data)
  with pytest.raises(StateMismatchError, match=f"{data} is missing"):
    _restore_into_new_iterator(manager, demo_config, demo_tokenizer)


def test_a_shard_file_linked_out_of_the_checkpoint_is_refused(demo_config, demo_tokenizer,
                                                              tmp_path):
  manager, data = _saved_checkpoint(demo_config, demo_tokenizer, tmp_path / "ck")
  shard = data / "shard_state_0-of-1.json"
  outside = tmp_path / "elsewhere.json"
  shard.rename(outside)
  shard.symlink_to(outside)
  with pytest.raises(StateMismatchError, match="links to a file outside the checkpoint"):
    _restore_into_new_iterator(manager, demo_config, demo_tokenizer)


def test_a_checkpoint_reached_through_a_linked_folder_restores(demo_config, demo_tokenizer,
                                                               tmp_path):
  _saved_checkpoint(demo_config, demo_tokenizer, tmp_path / "ck")
  (tmp_path / "link").symlink_to(tmp_path / "ck")
  _restore_into_new_iterator(checkpoint_manager(str(tmp_path / "link")), demo_config,
                             demo_tokenizer)


def _count_reads(monkeypatch):
  """Paths whose bytes `fs.read_file` read (an empty list until one is read)."""
  read = []
  real = checkpoint.fs.read_file

  def counting(path, max_bytes):
    data = real(path, max_bytes)
    read.append(str(path))
    return data
  monkeypatch.setattr(checkpoint.fs, "read_file", counting)
  return read


def test_a_relative_checkpoint_folder_is_taken_from_the_current_folder(
    demo_config, demo_tokenizer, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  manager, data = _saved_checkpoint(demo_config, demo_tokenizer, "ck")
  assert str(manager.directory) == str(tmp_path / "ck")
  assert (tmp_path / data).is_dir()
  _restore_into_new_iterator(manager, demo_config, demo_tokenizer)


def test_a_fifo_in_place_of_grains_per_process_file_is_refused_unopened(tmp_path):
  manager = checkpoint_manager(str(tmp_path / "ck"))
  it = iter(grain.MapDataset.range(10).to_iter_dataset())  # not the pipeline: Grain's own file
  next(it)
  save(manager, 1, {"w": jnp.zeros(3)}, it)
  process_file = tmp_path / "ck" / "1" / "data" / "process_0-of-1.json"
  process_file.unlink()
  with fifo(process_file) as rescued:
    with pytest.raises(StateMismatchError, match=f"{process_file} is not a regular file"):
      restore(manager, None, {"w": jnp.zeros(3)},
              iter(grain.MapDataset.range(10).to_iter_dataset()))
  assert not rescued
