"""Where a tokenizer is: special files refused unopened, Hub ids found in the local cache."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bagel_grain.errors import ConfigError
from bagel_grain.tokenizer import load_tokenizer
from bagel_grain.tokenizer_path import hub_cache_dir
from fifos import fifo


@pytest.fixture
def tokenizer_dir(demo_dir):
  return demo_dir / "tokenizer"


def test_a_fifo_as_the_tokenizer_path_is_refused_unopened(tmp_path):
  with fifo(tmp_path / "tokenizer.json") as rescued:
    with pytest.raises(ConfigError, match=r"tokenizer\.json is a special file \(a FIFO"):
      load_tokenizer(tmp_path / "tokenizer.json")
  assert not rescued


def test_a_fifo_inside_a_tokenizer_folder_is_refused_unopened(tokenizer_dir, tmp_path):
  folder = tmp_path / "tok"
  shutil.copytree(tokenizer_dir, folder)
  (folder / "tokenizer.json").unlink()
  with fifo(folder / "tokenizer.json") as rescued:
    with pytest.raises(ConfigError, match=r"tok/tokenizer\.json is a special file"):
      load_tokenizer(folder)
  assert not rescued


# --- Hugging Face Hub ids: the local cache `hf download` fills --------------------------


def fake_hub_cache(root, repo_id, tokenizer_dir, commit="0123456789abcdef0123456789abcdef01234567"):
  """The hub cache layout: blobs, a snapshot of links to them, and refs/main."""
  repo = root / ("models--" + repo_id.replace("/", "--"))
  snapshot = repo / "snapshots" / commit
  snapshot.mkdir(parents=True)
  (repo / "blobs").mkdir()
  for i, f in enumerate(sorted(tokenizer_dir.iterdir())):
    blob = repo / "blobs" / f"blob{i}"
    shutil.copy(f, blob)
    (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  return snapshot


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_loads_from_the_local_cache(tokenizer_dir, tmp_path, monkeypatch, variable):
  cache = tmp_path / "hub"
  snapshot = fake_hub_cache(cache, "ByteDance-Seed/BAGEL-7B-MoT", tokenizer_dir)
  for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv(variable, str(cache if variable == "HF_HUB_CACHE" else tmp_path))
  monkeypatch.chdir(tmp_path)  # no folder of that name here
  tok = load_tokenizer("ByteDance-Seed/BAGEL-7B-MoT")
  assert tok.path == snapshot
  assert tok.fingerprint() == load_tokenizer(tokenizer_dir).fingerprint()
  with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
    load_tokenizer("Qwen/Qwen2.5-7B-Instruct")


def test_a_local_folder_named_like_a_hub_id_wins_over_the_cache(tokenizer_dir, tmp_path,
                                                                monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  fake_hub_cache(tmp_path / "hub", "Org/Tok", tokenizer_dir)
  shutil.copytree(tokenizer_dir, tmp_path / "Org" / "Tok")
  monkeypatch.chdir(tmp_path)
  assert load_tokenizer("Org/Tok").path == Path("Org/Tok")


def test_a_cache_without_refs_main_is_not_used(tokenizer_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  fake_hub_cache(tmp_path / "hub", "Org/Tok", tokenizer_dir)
  (tmp_path / "hub" / "models--Org--Tok" / "refs" / "main").unlink()
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=re.escape("hf download Org/Tok")):
    load_tokenizer("Org/Tok")


@pytest.mark.parametrize("set_vars", [(), ("XDG_CACHE_HOME",), ("XDG_CACHE_HOME", "HF_HOME"),
                                      ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE")])
def test_the_cache_folder_is_the_one_huggingface_hub_uses(tmp_path, monkeypatch, set_vars):
  for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  for name in set_vars:
    monkeypatch.setenv(name, str(tmp_path / name.lower()))
  theirs = subprocess.run(  # huggingface_hub reads them once, at import: a fresh process
      [sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
      capture_output=True, text=True, check=True, timeout=60).stdout.strip()
  assert hub_cache_dir() == theirs
