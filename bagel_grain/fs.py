"""One filesystem layer (pyarrow.fs) for every file the pipeline touches.

Local paths and URIs (gs://, s3://, hdfs://) go through the same calls, so remote
storage needs no change in sources or families.
"""

from __future__ import annotations

import os
import posixpath

from pyarrow import fs as pafs


def is_uri(path: str) -> bool:
  return "://" in path


def join(base: str, *parts: str) -> str:
  if is_uri(base):
    return posixpath.join(base, *parts)
  return os.path.join(base, *parts)


def resolve(path: str, relative_to: str | None) -> str:
  """Resolves `path` against the folder `relative_to` unless it is absolute or a URI."""
  path = os.path.expanduser(str(path))
  if is_uri(path) or os.path.isabs(path) or relative_to is None:
    return path
  return join(relative_to, path)


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
  """The pyarrow filesystem holding `path`, and the path as that filesystem spells it."""
  if not is_uri(path):
    return pafs.LocalFileSystem(), os.path.abspath(path)
  return pafs.FileSystem.from_uri(path)


def exists(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.get_file_info(p).type != pafs.FileType.NotFound


def is_dir(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.get_file_info(p).type == pafs.FileType.Directory


def list_files(folder: str, suffix: str = "") -> list[str]:
  """Files directly inside `folder` whose names end with `suffix`, sorted by name."""
  fs, p = filesystem(folder)
  infos = fs.get_file_info(pafs.FileSelector(p, recursive=False))
  names = sorted(i.base_name for i in infos
                 if i.type == pafs.FileType.File and i.base_name.endswith(suffix))
  return [join(folder, n) for n in names]


def read_bytes(path: str) -> bytes:
  fs, p = filesystem(path)
  with fs.open_input_stream(p) as f:
    return f.read()


def open_random_access(path: str):
  """A seekable file object (for parquet footers and JSONL line offsets)."""
  fs, p = filesystem(path)
  return fs.open_input_file(p)
