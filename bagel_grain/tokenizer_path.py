"""Where a tokenizer is: a local path, or a Hugging Face Hub id found in the local cache.

NeMo recipes name the tokenizer by Hub id (`ByteDance-Seed/BAGEL-7B-MoT`); NeMo's
users run `hf download` first and expect the id to load from the cache, offline.
Everything the loaders would open is checked first to be a regular file or a
folder: a FIFO would block them forever.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from bagel_grain import fs
from bagel_grain.errors import ConfigError

# `organisation/name`, the shape of a Hugging Face Hub id.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SPECIAL_FILE = ("tokenizer path {path} is a {kind} (a FIFO, device or socket), never opened: "
                "give a tokenizer.json file or a tokenizer folder")


def hub_cache_dir() -> str:
  """The Hugging Face hub cache `hf download` fills, as `huggingface_hub` finds it."""
  if os.environ.get("HF_HUB_CACHE"):
    return os.path.expanduser(os.environ["HF_HUB_CACHE"])
  home = os.environ.get("HF_HOME") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
  return os.path.join(os.path.expanduser(home), "hub")


def cached_hub_snapshot(repo_id: str) -> str | None:
  """The folder of `repo_id`'s `main` revision in the local hub cache, or None.

  The cache's layout: `models--ORG--NAME/refs/main` holds the commit `hf download`
  fetched, whose files are in `models--ORG--NAME/snapshots/COMMIT/`. Nothing is
  asked of the network, as with `local_files_only=True`.
  """
  repo = os.path.join(hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
  try:
    with open(os.path.join(repo, "refs", "main"), encoding="ascii") as f:
      commit = f.read(100).strip()
  except (OSError, ValueError):
    return None
  snapshot = os.path.join(repo, "snapshots", commit)
  if not commit or os.sep in commit or commit.startswith(".") or not os.path.isdir(snapshot):
    return None
  return snapshot


def missing_tokenizer_message(value: str, resolved: str) -> str:
  """Why the tokenizer path `value` (`resolved` once made absolute) cannot be loaded."""
  message = (f"tokenizer path {resolved} does not exist; point it at a local tokenizer "
             "folder or tokenizer.json file")
  if _HUB_ID.fullmatch(value):
    message += (f". {value!r} looks like a Hugging Face Hub id, and it is not in the local "
                f"Hugging Face cache ({hub_cache_dir()}): bagel_grain reads tokenizers offline, "
                f"so download it first (`hf download {value}` into that cache, or `hf download "
                f"{value} --local-dir <folder>` and give that folder)")
  return message


def resolve_tokenizer_path(value: str, base_dir: str | None, *, file: str | None = None,
                           key: str = "tokenizer_path") -> str:
  """Where the tokenizer `value` is: a path (relative to `base_dir`) when one exists there,
  else the cached snapshot of a Hub id (what NeMo loads after `hf download`).

  ConfigError, naming `file` and `key`, when it is neither, or is not a regular file or
  folder (a FIFO would block the loader).
  """
  path = fs.resolve(value, base_dir)
  kind = fs.kind(path)
  if kind == "missing" and _HUB_ID.fullmatch(value) and not fs.is_uri(value):
    snapshot = cached_hub_snapshot(value)
    if snapshot is not None:
      return snapshot
  if kind == "missing":
    raise ConfigError(missing_tokenizer_message(value, path), file=file, key=key)
  if kind not in ("file", "folder"):
    raise ConfigError(SPECIAL_FILE.format(path=path, kind=kind), file=file, key=key)
  return path


def check_folder_entries(folder: Path) -> None:
  """Every entry of a tokenizer folder is a regular file or a folder: the Hugging Face
  loader opens the ones it knows without asking, and would wait forever on a FIFO."""
  for entry in os.scandir(folder):
    try:
      mode = os.stat(entry.path).st_mode  # follows the hub cache's links to its blobs
    except OSError:
      continue  # a dangling link: the loader says what it misses
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
      raise ConfigError(SPECIAL_FILE.format(path=entry.path, kind="special file"),
                        key="tokenizer_path")
