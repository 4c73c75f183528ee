"""What a dataset's records are made of, as a saved state remembers them.

A manifest lists a dataset's files relative to its root (the `data_dir` of a
parquet folder, the folder of a JSONL file, the ArrayRecord path), with their
sizes, and the number of blocks the dataset's source holds (parquet row groups,
JSONL lines in use, ArrayRecord records). Paths are relative, so the same data
copied to a bucket has the same manifest. A state carries one short summary per
dataset (`summary`: counts and a digest, some 80 bytes); a checkpoint keeps the
whole manifest beside it, so a restore onto changed data names the files that
changed (`changes`), and tells records appended from records rewritten
(`appended`): a JSONL's manifest also holds a digest of its last bytes (`tail`).

Where the data is indexed, the manifest also holds each file's content checksum
as the index recorded it (`contents`, `identity.Identity.checksum`), and the
summary a digest of them (`content`): a file rewritten at its size is then
refused by name. The checksums travel with the index, so a copy or an upload of
the corpus has the same ones; a side without them (data not indexed, a state
saved before them) compares sizes only, as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Sequence

from bagel_grain import fs
from bagel_grain.config import DatasetSpec
from bagel_grain.sources import sidecar
from bagel_grain.sources.array_record import array_record_files
from bagel_grain.sources.base import RecordSource
from bagel_grain.sources.jsonl import JsonlLineSource, tail_digest  # noqa: F401 (re-exported)
from bagel_grain.sources.parquet import ParquetRowSource


@dataclasses.dataclass(frozen=True)
class Manifest:
  """One dataset: its root, `files` as (relative path, bytes), and its source's blocks."""

  root: str
  files: tuple[tuple[str, int], ...]
  blocks: int
  tail: str | None = None  # a JSONL's last TAIL_BYTES, hashed: its lines still there?
  contents: tuple[tuple[str, str], ...] = ()  # (relative path, checksum) of indexed files

  def summary(self) -> dict[str, Any]:
    """What the state keeps of it: counts, a digest of the file list and sizes, and one of
    the files' content checksums when they are known."""
    listing = json.dumps([list(f) for f in self.files]).encode()
    out = {"files": len(self.files), "bytes": sum(size for _, size in self.files),
           "blocks": self.blocks, "digest": hashlib.sha256(listing).hexdigest()[:16]}
    if self.contents:
      checksums = json.dumps([list(c) for c in self.contents]).encode()
      out[CONTENT] = hashlib.sha256(checksums).hexdigest()[:16]
    return out

  def to_json(self) -> dict[str, Any]:
    tail = {} if self.tail is None else {"tail": self.tail}
    contents = {"contents": dict(self.contents)} if self.contents else {}
    return {"root": self.root, "files": [list(f) for f in self.files], "blocks": self.blocks,
            **tail, **contents}

  @classmethod
  def from_json(cls, value: Mapping[str, Any]) -> Manifest:
    tail = value.get("tail")
    contents = tuple(sorted((str(p), str(c)) for p, c in (value.get("contents") or {}).items()))
    return cls(str(value["root"]), tuple((str(p), int(n)) for p, n in value["files"]),
               int(value["blocks"]), None if tail is None else str(tail), contents)


CONTENT = "content"  # the summary's key for the content checksums' digest


def dataset_manifest(spec: DatasetSpec, record_format: str, source: RecordSource) -> Manifest:
  """The manifest of one dataset as its (unrestricted) source reads it: the listing of its
  folder the build made (a parquet source keeps it), or one look at its file; `record_format` as `Family.record_format` says."""
  if record_format == "array_record":
    paths = array_record_files(spec.array_record_path)
    root = spec.array_record_path if fs.is_dir(spec.array_record_path) else fs.dirname(
        spec.array_record_path)
    files = [(_relative(p, root), fs.file_info(p).size) for p in paths]
  elif record_format == "jsonl":
    root = fs.dirname(spec.jsonl_path)
    name = _relative(spec.jsonl_path, root)
    if isinstance(source, JsonlLineSource):  # the build's look at the file and its index
      size, tail, checksum = source.size, source.tail, source.indexed_checksum
    else:
      size = fs.file_info(spec.jsonl_path).size
      tail = tail_digest(spec.jsonl_path, size)
      checksum = sidecar.indexed_checksums(spec.jsonl_path, "jsonl").get(spec.jsonl_path)
    return Manifest(root, ((name, size),), source.num_blocks(), tail,
                    ((name, checksum),) if checksum else ())
  else:
    root = spec.data_dir
    if isinstance(source, ParquetRowSource) and source.listed:  # the build's listing, index
      files, checksums = list(source.listed), source.checksums
    else:
      files = [(i.base_name, i.size) for i in fs.list_file_infos(spec.data_dir, ".parquet")]
      checksums = sidecar.indexed_checksums(spec.data_dir, "parquet")
    return Manifest(root, tuple(sorted(files)), source.num_blocks(),
                    contents=tuple(sorted((name, checksums[fs.join(root, name)])
                                          for name, _ in files
                                          if fs.join(root, name) in checksums)))
  return Manifest(root, tuple(sorted(files)), source.num_blocks())


def _relative(path: str, root: str) -> str:
  """`path` under `root`, both made absolute first when local (a config may give either)."""
  if not fs.is_uri(path):
    path, root = os.path.abspath(path), os.path.abspath(root)
  return path[len(root):].lstrip("/") if path.startswith(root) else path


def rewritten(saved: Manifest, now: Manifest) -> list[str]:
  """Files both sides know the content checksum of, and whose checksums differ."""
  before, after = dict(saved.contents), dict(now.contents)
  return sorted(p for p in set(before) & set(after) if before[p] != after[p])


def changes(saved: Manifest, now: Manifest) -> list[str]:
  """What differs, file by file: added, removed, resized, rewritten; then the blocks."""
  before, after = dict(saved.files), dict(now.files)
  out = [f"{p} added ({after[p]} bytes)" for p in sorted(set(after) - set(before))]
  out += [f"{p} removed" for p in sorted(set(before) - set(after))]
  out += [f"{p} changed size ({before[p]} -> {after[p]} bytes)"
          for p in sorted(set(before) & set(after)) if before[p] != after[p]]
  out += [f"{p} rewritten (its content checksum differs from the saved one)"
          for p in rewritten(saved, now) if before.get(p) == after.get(p)]
  if saved.blocks != now.blocks:
    out.append(f"blocks (row groups, lines or records) {saved.blocks} -> {now.blocks}")
  return out


def appended(saved: Manifest, now: Manifest, record_format: str) -> str | None:
  """What was appended ("sft.jsonl: 6 lines appended", "part-9.parquet added"), when the
  dataset only grew: every file it had is still there, a parquet file at its size, a
  JSONL longer (its old lines are checked when the stream is built: `jsonl_prefix`).
  None when records were removed or rewritten, or nothing was appended."""
  before, after = dict(saved.files), dict(now.files)
  if set(before) - set(after) or rewritten(saved, now) and record_format != "jsonl":
    return None
  if record_format == "jsonl" and len(before) == len(after) == 1:
    (name, size), = saved.files
    grown = now.blocks - saved.blocks
    return f"{name}: {grown} lines appended" if after[name] > size and grown > 0 else None
  if record_format != "parquet" or any(after[p] != n for p, n in before.items()):
    return None
  added = sorted(set(after) - set(before))
  return f"{', '.join(added)} added" if added else None


def summary_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
  """What differs between two summaries, when the manifests themselves are not at hand."""
  out = [f"{key} {saved.get(key)} -> {now.get(key)}" for key in ("files", "bytes", "blocks")
         if saved.get(key) != now.get(key)]
  if not out and saved.get("digest") != now.get("digest"):
    out.append("file names or sizes (same totals)")
  if not out and None not in (saved.get(CONTENT), now.get(CONTENT)) and (
      saved.get(CONTENT) != now.get(CONTENT)):
    out.append("file contents (same names and sizes; the checkpoint's file lists name them)")
  return out


def describe(name: str, manifest: Manifest | None, changed: Sequence[str]) -> str:
  """One dataset's changes, as an error names them."""
  where = f" under {manifest.root}" if manifest is not None else ""
  return f"dataset {name!r}{where}: {'; '.join(changed)}"
