"""One filesystem layer (pyarrow.fs) for every file the pipeline touches.

Local paths and URIs (gs://, s3://, hdfs://) go through the same calls, so remote
storage needs no change in sources or families. Endpoints and credentials come
from the environment, as the clouds' own tools read them (never from code):

- s3://: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
  `AWS_DEFAULT_REGION` / `AWS_REGION`, and `AWS_ENDPOINT_URL_S3` or
  `AWS_ENDPOINT_URL` for an S3-compatible server (`http://host:port`).
- gs://: Google's default credentials (`GOOGLE_APPLICATION_CREDENTIALS`, the
  metadata server), and `STORAGE_EMULATOR_HOST` for a GCS emulator (then anonymous).

One filesystem object per scheme, bucket and environment is made per process
and reused: a new S3 or GCS client for every read would cost a handshake each,
and the client keeps its connections open between requests.

The clients' own retries are off or short (S3: 1 attempt; GCS: 1 s) and a request
that receives nothing for `REQUEST_TIMEOUT_S` is cut: the retries that wait out
an outage are `storage.RetryPolicy`'s, which count them, log once per outage and
stop at the configured deadline.
"""

from __future__ import annotations

import datetime
import functools
import os
import posixpath
import shutil
import stat
import tempfile
import urllib.parse

from pyarrow import fs as pafs

REQUEST_TIMEOUT_S = 10.0  # a request that receives nothing for this long fails (transient)
CONNECT_TIMEOUT_S = 5.0
_CLIENT_ATTEMPTS = 1  # S3 client: no retry of its own, every failure reaches ours
_CLIENT_RETRY_S = 1  # GCS client: its own retries end within a second, then ours
_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION",
        "STORAGE_EMULATOR_HOST")


def is_uri(path: str) -> bool:
  return "://" in path


def join(base: str, *parts: str) -> str:
  if is_uri(base):
    return posixpath.join(base, *parts)
  return os.path.join(base, *parts)


def dirname(path: str) -> str:
  """The folder holding `path` (a URI keeps its scheme and bucket)."""
  if is_uri(path):
    return posixpath.dirname(path.rstrip("/"))
  return os.path.dirname(os.path.abspath(path))


def resolve(path: str, relative_to: str | None) -> str:
  """Resolves `path` against the folder `relative_to` unless it is absolute or a URI."""
  path = os.path.expanduser(str(path))
  if is_uri(path) or os.path.isabs(path) or relative_to is None:
    return path
  return join(relative_to, path)


def _endpoint(url: str) -> tuple[str, str]:
  """(scheme, host:port) of an endpoint given as `http://host:port` or `host:port`."""
  parsed = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
  return parsed.scheme, parsed.netloc


@functools.lru_cache(maxsize=None)
def _remote(scheme: str, env: tuple) -> pafs.FileSystem:
  settings = dict(zip(_ENV, env))
  if scheme == "s3":
    url = settings["AWS_ENDPOINT_URL_S3"] or settings["AWS_ENDPOINT_URL"]
    region = settings["AWS_DEFAULT_REGION"] or settings["AWS_REGION"]
    kwargs = {"region": region} if region else {}
    kwargs.update(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=_CLIENT_ATTEMPTS),
                  request_timeout=REQUEST_TIMEOUT_S, connect_timeout=CONNECT_TIMEOUT_S)
    if url:
      kwargs["scheme"], kwargs["endpoint_override"] = _endpoint(url)
    return pafs.S3FileSystem(**kwargs)
  if scheme in ("gs", "gcs"):
    host = settings["STORAGE_EMULATOR_HOST"]
    if host:
      http, netloc = _endpoint(host)
      return pafs.GcsFileSystem(anonymous=True, endpoint_override=netloc, scheme=http,
                                retry_time_limit=_gcs_retry())
    return pafs.GcsFileSystem(retry_time_limit=_gcs_retry())
  raise ValueError(scheme)


def _gcs_retry() -> datetime.timedelta:
  return datetime.timedelta(seconds=_CLIENT_RETRY_S)


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
  """The pyarrow filesystem holding `path`, and the path as that filesystem spells it."""
  if not is_uri(path):
    return pafs.LocalFileSystem(), os.path.abspath(path)
  scheme, rest = path.split("://", 1)
  if scheme in ("s3", "gs", "gcs"):
    return _remote(scheme, tuple(os.environ.get(k) for k in _ENV)), rest.rstrip("/")
  return pafs.FileSystem.from_uri(path)


def exists(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.get_file_info(p).type != pafs.FileType.NotFound


def is_dir(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.get_file_info(p).type == pafs.FileType.Directory


def kind(path: str) -> str:
  """"file" (a regular file), "folder", "missing", or "special file" (FIFO, device, socket)."""
  return kind_of(file_info(path))


def kind_of(info: pafs.FileInfo) -> str:
  """`kind` of a path whose `file_info` is at hand (one request less on an object store)."""
  return {pafs.FileType.File: "file", pafs.FileType.Directory: "folder",
          pafs.FileType.NotFound: "missing"}.get(info.type, "special file")


def file_info(path: str) -> pafs.FileInfo:
  """Type, size and modification time of one path (one request on an object store)."""
  fs, p = filesystem(path)
  return fs.get_file_info(p)


def list_file_infos(folder: str, suffix: str = "") -> list[pafs.FileInfo]:
  """Files directly inside `folder` whose names end with `suffix`, sorted by name.

  One listing (a few requests on an object store, whatever the number of files)
  gives every file's size and modification time.
  """
  fs, p = filesystem(folder)
  infos = fs.get_file_info(pafs.FileSelector(p, recursive=False))
  return sorted((i for i in infos
                 if i.type == pafs.FileType.File and i.base_name.endswith(suffix)),
                key=lambda i: i.base_name)


def list_files(folder: str, suffix: str = "") -> list[str]:
  """Files directly inside `folder` whose names end with `suffix`, sorted by name."""
  return [join(folder, i.base_name) for i in list_file_infos(folder, suffix)]


def read_bytes(path: str) -> bytes:
  fs, p = filesystem(path)
  with fs.open_input_stream(p) as f:
    return f.read()


class FileRefused(OSError):
  """A file not read on purpose: `regular` False for a FIFO, device or socket, else too large."""

  def __init__(self, message: str, *, regular: bool):
    super().__init__(message)
    self.regular = regular


def read_file(path: str, max_bytes: int | None) -> bytes:
  """A regular file's bytes; anything else, or more than `max_bytes`, is refused unread.

  Locally, one stat decides before anything is opened: a FIFO, device or socket
  is never opened (opening a FIFO waits for a writer), and a huge file is never
  read into memory; the file is checked again on the opened descriptor, in case
  it was swapped in between. An object is opened at once (no listing or HEAD of
  ours first: an object store holds only regular files, a missing one answers
  404 to the read itself) and at most `max_bytes` + 1 bytes are asked for.
  Raises FileRefused, FileNotFoundError, or OSError when it cannot be read
  (`storage.is_transient` tells whether trying again may help).
  """
  limit = -1 if max_bytes is None else max_bytes + 1  # one byte more tells it grew
  if is_uri(path):
    fs, p = filesystem(path)
    with fs.open_input_stream(p) as f:
      data = f.read(limit if limit > 0 else None)
  else:
    info = os.stat(path)
    _check_file(path, stat.S_ISREG(info.st_mode), info.st_size, max_bytes)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as f:
      info = os.fstat(fd)
      _check_file(path, stat.S_ISREG(info.st_mode), info.st_size, max_bytes)
      data = f.read(limit)
  _check_file(path, True, len(data), max_bytes)
  return data


def _check_file(path: str, regular: bool, size: int, max_bytes: int | None) -> None:
  if not regular:
    raise FileRefused(f"{path} is not a regular file", regular=False)
  if max_bytes is not None and size > max_bytes:
    raise FileRefused(f"{path}: {size} bytes > {max_bytes}", regular=True)


def write_bytes(path: str, data: bytes) -> None:
  """Writes a whole file; on an object store the object appears only once complete."""
  fs, p = filesystem(path)
  if not is_uri(path):
    os.makedirs(os.path.dirname(p), exist_ok=True)
  with fs.open_output_stream(p) as f:
    f.write(data)


def open_random_access(path: str):
  """A seekable file object (for parquet footers and JSONL line offsets)."""
  fs, p = filesystem(path)
  return fs.open_input_file(p)


def open_output(path: str):
  """A writable stream (local folders are created)."""
  fs, p = filesystem(path)
  if not is_uri(path):
    os.makedirs(os.path.dirname(p), exist_ok=True)
  return fs.open_output_stream(p)


class LocalCopy:
  """A remote folder or file copied to a temporary local folder, deleted on exit.

  For libraries that only open local paths (a Hugging Face tokenizer folder).
  A local path is used as it is.
  """

  def __init__(self, path: str):
    self._path, self._tmp = path, None

  def __enter__(self) -> str:
    if not is_uri(self._path):
      return self._path
    self._tmp = tempfile.mkdtemp(prefix="bagel-grain-")
    if not is_dir(self._path):
      local = os.path.join(self._tmp, posixpath.basename(self._path.rstrip("/")))
      with open(local, "wb") as f:
        f.write(read_bytes(self._path))
      return local
    for name in list_files(self._path):
      with open(os.path.join(self._tmp, posixpath.basename(name)), "wb") as f:
        f.write(read_bytes(name))
    return self._tmp

  def __exit__(self, *exc) -> None:
    if self._tmp is not None:
      shutil.rmtree(self._tmp, ignore_errors=True)
