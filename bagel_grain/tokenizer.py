"""The text tokenizer: a Hugging Face tokenizer plus BAGEL's four special tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import tokenizers

from bagel_grain import fs
from bagel_grain.errors import ConfigError
from bagel_grain.tokenizer_path import (SPECIAL_FILE, check_folder_entries,
                                        missing_tokenizer_message, resolve_tokenizer_path)
# One definition, shared with the packer that consumes the ids.
from bagel_grain.sample import SpecialTokens

# Upstream's names for these ids: bos_token_id, eos_token_id, start_of_image, end_of_image.
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
START_OF_IMAGE_TOKEN = "<|vision_start|>"
END_OF_IMAGE_TOKEN = "<|vision_end|>"
BAGEL_TOKENS = (BOS_TOKEN, EOS_TOKEN, START_OF_IMAGE_TOKEN, END_OF_IMAGE_TOKEN)

def _folder_error(path: Path, error: Exception) -> ConfigError:
  """What is wrong with a tokenizer folder the Hugging Face loader refused.

  transformers reports a malformed `tokenizer.json` as whatever it tripped on (a
  `KeyError: 'added_tokens'` for `{"model": 1}`): the Rust loader names the file.
  """
  json_file = path / "tokenizer.json"
  if json_file.is_file():
    try:
      tokenizers.Tokenizer.from_file(str(json_file))
    except Exception as e:  # pylint: disable=broad-except  # the Rust loader's bare Exception
      return ConfigError(f"{json_file} is not a tokenizers JSON file: {e}",
                         key="tokenizer_path")
  return ConfigError(f"cannot load a Hugging Face tokenizer from {path}: "
                     f"{type(error).__name__}: {error}", key="tokenizer_path")


class _DropTorchAdvice(logging.Filter):
  """Drops transformers' import-time "PyTorch was not found" advice: we never use torch."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found")


@contextlib.contextmanager
def _quiet_transformers_import():
  """Filters the `transformers` logger only while we import it; nothing else changes."""
  logger = logging.getLogger("transformers")
  quiet = _DropTorchAdvice()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


def _load_backend(path: Path) -> tuple[tokenizers.Tokenizer | None, Any]:
  """Returns (Rust tokenizer, Hugging Face wrapper or None) for a file or a directory.

  A directory goes through `AutoTokenizer` so a tokenizer class that rebuilds its
  pipeline from its own config gets the same ids as in upstream; the Rust object it
  wraps is then used directly (one call, no Python-side per-token work).
  """
  kind = fs.kind(str(path))
  if kind == "missing":
    raise ConfigError(missing_tokenizer_message(str(path), str(path)), key="tokenizer_path")
  if kind not in ("file", "folder"):
    raise ConfigError(SPECIAL_FILE.format(path=path, kind=kind), key="tokenizer_path")
  if kind == "file":
    try:
      return tokenizers.Tokenizer.from_file(str(path)), None
    except Exception as e:  # the Rust loader raises a bare Exception
      raise ConfigError(f"{path} is not a tokenizers JSON file: {e}",
                        key="tokenizer_path") from e
  with _quiet_transformers_import():
    import transformers  # slow import; only needed for directories

  check_folder_entries(path)
  try:
    hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  except Exception as e:  # pylint: disable=broad-except  # a malformed file raises anything
    raise _folder_error(path, e) from e
  return getattr(hf, "backend_tokenizer", None), hf


class Tokenizer:
  """Encodes text as upstream does: `add_special_tokens=False`, int32 ids.

  BAGEL's four special tokens are added when missing from the vocabulary, so a Qwen2
  tokenizer, which already has them, keeps its ids. Pickling sends the tokenizer's
  JSON (or, for a tokenizer without a Rust backend, its path) to worker processes.
  """

  def __init__(self, path: str | os.PathLike[str] | None):
    if path is None:
      raise ConfigError(
          "no tokenizer path: set `tokenizer_path` (a bagel_grain config), or "
          "`tokenizer.pretrained_model_name_or_path` or `model.pretrained_model_name_or_path` "
          "(a NeMo recipe), to a local tokenizer folder or tokenizer.json file, or pass "
          "the path to `load_tokenizer`",
          key="tokenizer_path")
    self.path = Path(path)
    backend, hf = _load_backend(self.path)
    self._setup(backend, hf)

  def _setup(self, backend: tokenizers.Tokenizer | None, hf: Any) -> None:
    if backend is not None:
      # transformers turns these off for a call without truncation or padding
      # arguments (upstream's call); a tokenizer.json may have them saved on.
      backend.no_truncation()
      backend.no_padding()
    self._backend = backend
    # Only kept when there is no Rust backend to call directly.
    self._hf = hf if backend is None else None
    self._fingerprint: str | None = None
    self._longest: int | None = None
    missing = [t for t in BAGEL_TOKENS if self._token_id(t) is None]
    if missing:
      if backend is not None:
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                    for t in missing])
      else:
        self._hf.add_tokens(missing, special_tokens=True)
    ids = [self._token_id(t) for t in BAGEL_TOKENS]
    if None in ids or len(set(ids)) != 4:
      raise ConfigError(f"tokenizer {self.path} gives special token ids "
                        f"{dict(zip(BAGEL_TOKENS, ids))}; they must be four distinct ids",
                        key="tokenizer_path")
    self.special = SpecialTokens(*ids)

  def _token_id(self, token: str) -> int | None:
    if self._backend is not None:
      return self._backend.token_to_id(token)
    return self._hf.get_vocab().get(token)

  @property
  def vocab_size(self) -> int:
    """Vocabulary size including added tokens (`len(tokenizer)` in transformers)."""
    if self._backend is not None:
      return self._backend.get_vocab_size(with_added_tokens=True)
    return len(self._hf)

  @property
  def longest_token_chars(self) -> int:
    """The most characters one token covers: its vocabulary's longest token string.

    Byte-level BPE (Qwen2) spells each byte as one character and SentencePiece each
    character as one, so no token covers more characters of text than its string has.
    """
    if self._longest is None:
      vocab = (self._backend.get_vocab(with_added_tokens=True) if self._backend is not None
               else self._hf.get_vocab())
      self._longest = max(len(token) for token in vocab)
    return self._longest

  def encode(self, text: str) -> np.ndarray:
    if self._backend is not None:
      ids = self._backend.encode(text, add_special_tokens=False).ids
    else:
      ids = self._hf.encode(text, add_special_tokens=False)
    return np.asarray(ids, dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Same ids as `encode` per text, in one call (the Rust side parallelises it)."""
    texts = list(texts)
    if not texts:
      return []
    if self._backend is not None:
      encs = self._backend.encode_batch(texts, add_special_tokens=False)
      all_ids = [e.ids for e in encs]
    else:
      all_ids = self._hf(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(ids, dtype=np.int32) for ids in all_ids]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = [int(i) for i in ids]
    if self._backend is not None:
      return self._backend.decode(ids, skip_special_tokens=False)
    return self._hf.decode(ids, skip_special_tokens=False)

  def fingerprint(self) -> str:
    """A short hash of everything that decides the ids; stored with checkpoints so a
    resumed run notices a changed tokenizer."""
    if self._fingerprint is None:
      h = hashlib.sha256()
      if self._backend is not None:
        state = json.loads(self._backend.to_str())
        # Only applied with add_special_tokens=True, which we never ask for; transformers
        # installs one when loading a directory, the bare tokenizer.json may have none.
        state.pop("post_processor", None)
        h.update(json.dumps(state, sort_keys=True).encode())
        added = self._backend.get_added_tokens_decoder()
      else:
        h.update(json.dumps(sorted(self._hf.get_vocab().items())).encode())
        added = self._hf.added_tokens_decoder
      h.update(json.dumps(sorted((i, str(t)) for i, t in added.items())).encode())
      h.update(json.dumps(dataclasses.astuple(self.special)).encode())
      self._fingerprint = h.hexdigest()[:16]
    return self._fingerprint

  def __getstate__(self) -> dict[str, Any]:
    backend_json = self._backend.to_str() if self._backend is not None else None
    return {"path": str(self.path), "backend_json": backend_json}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.path = Path(state["path"])
    if state["backend_json"] is not None:
      # The JSON already holds the added special tokens, so the ids are unchanged.
      self._setup(tokenizers.Tokenizer.from_str(state["backend_json"]), None)
    else:
      self._setup(*_load_backend(self.path))

  def __repr__(self) -> str:
    return (f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"special={self.special})")


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
  """Loads a `tokenizer.json` file or a Hugging Face tokenizer directory (no hub access).

  A Hub id (`Qwen/Qwen2.5-7B-Instruct`) that is not a local path loads from the local
  Hugging Face cache when `hf download` put it there. A gs:// or s3:// path is copied
  to a temporary folder first, loaded, and deleted.
  """
  if path is None:
    return Tokenizer(None)  # the error that says where to set the path
  path = resolve_tokenizer_path(str(path), None)
  with fs.LocalCopy(path) as local:
    return Tokenizer(local)
