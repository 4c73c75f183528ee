"""One filesystem layer for every file the pipeline touches.

Local paths and URIs (gs://, s3://) go through the same calls, so remote storage
needs no change in sources or families. Endpoints and credentials come from the
environment, as the clouds' own tools read them (never from code):

- s3://: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN` (or the
  `AWS_PROFILE` of `~/.aws/credentials`), `AWS_DEFAULT_REGION` / `AWS_REGION`, and
  `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` for an S3-compatible server.
- gs://: an OAuth token (`GOOGLE_OAUTH_ACCESS_TOKEN`, google-auth's default
  credentials if installed, else the metadata server), and `STORAGE_EMULATOR_HOST`
  for a GCS emulator (then anonymous).

Reads and listings of objects go through our own bounded client (`remote.s3`,
`remote.gcs` over `remote.http`): every request ends by the deadline of its
scope (`deadline_scope`, which `storage.RetryPolicy` sets for each attempt), a
body is read to at most its bound, a listing to at most `max_entries` files and
never in circles, and redirects are not followed. Outside an element's computation
(a build's listings, HEADs, footers, index files, probes), each read waits out
transient failures under the build's policy (`storage.retried`). Writes and deletes go through
the same clients: an object appears only once whole (one PUT, or a multipart or
resumable upload sent a part at a time from a local file), and each request is
retried on transient faults for up to `WRITE_TIMEOUT_S` (`StorageWriteError` after).

The API other modules build on (stable):

- `FileInfo` (`file_info(path)`, `list_file_infos(folder, suffix, max_entries=)`):
  `.path .kind .size .mtime_ns .base_name`, and the identity of the content as
  the store reports it: `.etag`, `.generation` (GCS generation, S3 version id),
  `.md5` (hex), `.crc32c` (8 hex digits), each None where unknown (always on
  local disk); `.content_id` sums them up ("md5:...", "crc32c:...", "etag:...").
- `read_file(path, max_bytes, pin=None)`, `read_range(path, offset, length,
  pin=None)`, `open_random_access(path, pin=None)`: with `pin` (the `FileInfo` a
  listing gave) the bytes read are those the listing saw: GCS reads that
  generation (an identical re-upload, same crc32c and MD5, is read in its place),
  S3 sends `If-Match: <ETag>`, local disk compares size and modification time.
  Otherwise `ObjectChanged`, a definite answer.
- Definite answers raise `FileNotFoundError`, `PermissionError`, `FileRefused`
  (too large, not a regular file), `ObjectChanged`, `ListingError`
  (`ListingTooLong` past `max_entries`, `BadListing` for a store that pages in
  circles); transient ones `ConnectionError` / `TimeoutError`
  (`storage.is_transient`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import posixpath
import shutil
import stat
import tempfile

import pyarrow as pa
from pyarrow import fs as pafs

from bagel_grain import storage
from bagel_grain.errors import StorageUnavailableError, StorageWriteError
from bagel_grain.remote import gcs, http, s3
from bagel_grain.remote.http import deadline_scope  # noqa: F401  (re-exported)
from bagel_grain.remote.objects import (MAX_LIST_ENTRIES, BadListing, FileInfo,  # noqa: F401
                                        ListingError, ListingTooLong)
from bagel_grain.remote.writes import UploadSource

WRITE_TIMEOUT_S = storage.DEFAULT_TIMEOUT_S  # how long one request of a write is retried
_DOWNLOAD_CHUNK = 16 << 20
_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION",
        "STORAGE_EMULATOR_HOST", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE")
_NO_BOUND = 1 << 62


class ObjectChanged(http.DefiniteError):
  """The file is not the one its listing saw (the pin): other bytes, a rewrite."""


class FileRefused(http.DefiniteError):
  """A file not read on purpose: `regular` False for a FIFO, device or socket, else too large."""

  def __init__(self, message: str, *, regular: bool):
    super().__init__(message)
    self.regular = regular


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


def _env() -> tuple:
  return tuple(os.environ.get(k) for k in _ENV)


@functools.lru_cache(maxsize=None)
def _client(scheme: str, env: tuple) -> s3.S3Client | gcs.GCSClient:
  settings = dict(zip(_ENV, env))
  return s3.S3Client(settings) if scheme == "s3" else gcs.GCSClient(settings)


def _object(path: str) -> tuple[s3.S3Client | gcs.GCSClient, str, str] | None:
  """(client, bucket, key) of an s3:// or gs:// URI; None for any other path."""
  if not is_uri(path):
    return None
  scheme, rest = path.split("://", 1)
  if scheme not in ("s3", "gs", "gcs"):
    return None
  bucket, _, key = rest.partition("/")
  return _client("s3" if scheme == "s3" else "gs", _env()), bucket, key


def exists(path: str) -> bool:
  return file_info(path).kind != "missing"


def is_dir(path: str) -> bool:
  return file_info(path).kind == "folder"


def kind(path: str) -> str:
  """"file" (a regular file), "folder", "missing", or "special file" (FIFO, device, socket)."""
  return file_info(path).kind


def kind_of(info: FileInfo) -> str:
  """`kind` of a path whose `file_info` is at hand (one request less on an object store)."""
  return info.kind


def file_info(path: str) -> FileInfo:
  """Type, size, modification time and reported identity of one path (on an object store
  one request, two for a folder)."""
  remote = _object(path)
  if remote is None:
    return _local_info(os.path.abspath(path), follow=True)
  return storage.retried(path, lambda: _object_info(path, *remote))


def _object_info(path: str, client, bucket: str, key: str) -> FileInfo:
  key = key.rstrip("/")
  if key:
    try:
      return client.head(bucket, key)
    except FileNotFoundError:
      pass
  folder = client.has_children(bucket, f"{key}/" if key else "")
  return FileInfo(path, "folder" if folder else "missing")


def _local_info(path: str, follow: bool) -> FileInfo:
  try:
    st = os.stat(path) if follow else os.lstat(path)
  except FileNotFoundError:
    return FileInfo(path, "missing")
  kind = ("file" if stat.S_ISREG(st.st_mode) else "folder" if stat.S_ISDIR(st.st_mode)
          else "special file")
  return FileInfo(path, kind, st.st_size, st.st_mtime_ns)


def list_file_infos(folder: str, suffix: str = "",
                    max_entries: int = MAX_LIST_ENTRIES) -> list[FileInfo]:
  """Files directly inside `folder` whose names end with `suffix`, sorted by name.

  One listing (a few requests on an object store, whatever the number of files)
  gives every file's size, time and reported identity. More than `max_entries`
  files in the folder is `ListingTooLong`.
  """
  remote = _object(folder)
  if remote is None:
    folder = os.path.abspath(folder)
    names = []
    with os.scandir(folder) as entries:
      for entry in entries:
        names.append(entry.name)
        if len(names) > max_entries:
          raise ListingTooLong(f"{folder} holds more than {max_entries} files", max_entries)
    infos = (_local_info(os.path.join(folder, n), follow=True) for n in names
             if n.endswith(suffix))
    infos = [i for i in infos if i.kind == "file"]
  else:
    client, bucket, key = remote
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    infos = [i for i in storage.retried(folder, lambda: client.list(bucket, prefix, max_entries))
             if i.base_name.endswith(suffix)]
    base = folder.rstrip("/")
    infos = [dataclasses.replace(i, path=f"{base}/{i.base_name}") for i in infos]
  return sorted(infos, key=lambda i: i.base_name)


def list_files(folder: str, suffix: str = "", max_entries: int = MAX_LIST_ENTRIES) -> list[str]:
  """Files directly inside `folder` whose names end with `suffix`, sorted by name."""
  return [join(folder, i.base_name) for i in list_file_infos(folder, suffix, max_entries)]


def read_bytes(path: str) -> bytes:
  """A whole file (configs, indexes: files the pipeline wrote or was given)."""
  return read_file(path, None)


def read_file(path: str, max_bytes: int | None, pin: FileInfo | None = None) -> bytes:
  """A regular file's bytes; anything else, or more than `max_bytes`, is refused unread.

  Locally, one stat decides before anything is opened: a FIFO, device or socket
  is never opened (opening a FIFO waits for a writer), and a huge file is never
  read into memory; the file is checked again on the opened descriptor, in case
  it was swapped in between. An object is read at once (no HEAD first: a missing
  one answers 404 to the read itself); a declared size over `max_bytes` is refused
  before a byte is read, and at most `max_bytes` + 1 bytes are ever held.
  With `pin`, the bytes are those of the listing entry `pin` (see the module doc).
  Raises FileRefused, ObjectChanged, FileNotFoundError, or OSError when it cannot be
  read (`storage.is_transient` tells whether trying again may help).
  """
  remote = _object(path)
  if remote is not None:
    client, bucket, key = remote
    try:
      data = storage.retried(path, lambda: client.get(
          bucket, key, max_bytes=_NO_BOUND if max_bytes is None else max_bytes, pin=pin))
    except http.BodyTooLarge as e:
      size = f"{e.size} bytes >" if e.size is not None else "more than"
      raise FileRefused(f"{path}: {size} {max_bytes} bytes", regular=True) from None
    except http.PreconditionFailed:
      raise ObjectChanged(_changed(path, pin)) from None
  else:
    limit = -1 if max_bytes is None else max_bytes + 1  # one byte more tells it grew
    info = os.stat(path)
    _check_file(path, stat.S_ISREG(info.st_mode), info.st_size, max_bytes)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as f:
      info = os.fstat(fd)
      _check_file(path, stat.S_ISREG(info.st_mode), info.st_size, max_bytes)
      _check_pin(path, info.st_size, info.st_mtime_ns, pin)
      data = f.read(limit)
  _check_file(path, True, len(data), max_bytes)
  return data


def _changed(path: str, pin: FileInfo | None) -> str:
  seen = pin and (f"ETag {pin.etag}" if pin.etag else f"generation {pin.generation}")
  return f"{path} changed since it was listed (the store no longer has the {seen} listed)"


def _check_pin(path: str, size: int, mtime_ns: int, pin: FileInfo | None) -> None:
  why = pin_differs(path, size, mtime_ns, pin)
  if why:
    raise ObjectChanged(f"{path} changed since it was listed ({why})")


def pin_differs(path: str, size: int, mtime_ns: int, pin: FileInfo | None) -> str | None:
  """Why the local file `path`, now of `size` and `mtime_ns`, is not the one `pin` saw;
  None if it is: its size and time agree, or, at the same size and another time (a
  `touch`, an identical file uploaded again seen through a mount), its probe agrees with
  the pin's (computed once per file and time in a process, then remembered)."""
  if pin is None or (size, mtime_ns) == (pin.size, pin.mtime_ns):
    return None
  if size == pin.size and pin.probe is not None:
    kind, digest = pin.probe
    if _probe_at(path, kind, size, mtime_ns) == digest:
      return None
    return f"same size, a new time, and its {_PROBED[kind]} differs"
  return f"size, mtime now {(size, mtime_ns)}, then {(pin.size, pin.mtime_ns)}"


def with_probe(pin: FileInfo, kind: str) -> FileInfo:
  """A local file's pin (its listing) with its probe, so that its reads accept the same
  content at another time; unchanged for an object (its store identifies its content),
  or if the file was no longer at the pin's size and time once probed."""
  if is_uri(pin.path) or pin.probe is not None:
    return pin
  digest = _probe_at(pin.path, kind, int(pin.size), int(pin.mtime_ns))
  return pin if digest is None else dataclasses.replace(pin, probe=(kind, digest))


_PROBED = {"parquet": "footer", "jsonl": "first or last MiB"}
PROBE_BYTES = 1 << 20  # a JSONL file's probe: its first and last MiB


def probe(path: str, kind: str) -> str:
  """SHA-256 of the bytes that stand for a file in a cheap check (`sources.identity`): a
  parquet file's footer (and its length and magic), a JSONL file's first and last
  `PROBE_BYTES`, with its size."""
  with open_random_access(path) as f:
    size = f.size()
    if kind == "parquet":
      tail = f.read_at(min(size, 8), max(0, size - 8))
      footer = int.from_bytes(tail[:4], "little") + 8 if len(tail) == 8 else len(tail)
      data = f.read_at(min(size, footer), max(0, size - footer))
    else:
      data = f.read_at(min(size, PROBE_BYTES), 0)
      if size > PROBE_BYTES:
        data += f.read_at(min(size - PROBE_BYTES, PROBE_BYTES), max(PROBE_BYTES,
                                                                     size - PROBE_BYTES))
  return hashlib.sha256(size.to_bytes(8, "little") + data).hexdigest()


@functools.lru_cache(maxsize=4096)
def _probe_at(path: str, kind: str, size: int, mtime_ns: int) -> str | None:
  """`probe` of a local file seen at (size, mtime_ns); None if it changed while read."""
  digest = probe(path, kind)
  st = os.stat(path)
  return digest if (st.st_size, st.st_mtime_ns) == (size, mtime_ns) else None


def read_range(path: str, offset: int, length: int, pin: FileInfo | None = None) -> bytes:
  """`length` bytes from `offset` (fewer at the end of the file): one ranged request on an
  object store, one `pread` locally. With `pin` as in `read_file`."""
  if length <= 0:
    return b""
  remote = _object(path)
  if remote is None:
    with open(path, "rb") as f:
      if pin is not None:  # only a pinned read asks what the file is now
        st = os.fstat(f.fileno())
        _check_pin(path, st.st_size, st.st_mtime_ns, pin)
      return os.pread(f.fileno(), length, offset)
  client, bucket, key = remote
  try:
    return storage.retried(path, lambda: client.get(
        bucket, key, max_bytes=length, first=offset, last=offset + length - 1, pin=pin))
  except http.PreconditionFailed:
    raise ObjectChanged(_changed(path, pin)) from None
  except http.HTTPStatusError as e:
    if e.status == 416:  # nothing at or past the end
      return b""
    raise


class ObjectHandle:
  """One object's ranged reads (`read_at(length, offset)`, as a pyarrow file's), each its
  own request, pinned to the identity `info` (its listing or HEAD) seen when it was
  opened: every range is of that content (GCS generation, S3 ETag), and a change is
  `ObjectChanged`, a definite answer. Nothing is held open and nothing is shared between
  reads, so threads read ranges of one object at once (pyarrow's `PythonFile` holds a
  lock across each of its reads)."""

  def __init__(self, path: str, info: FileInfo):
    self.path, self.info = path, info

  def size(self) -> int:
    return int(self.info.size)

  def read_at(self, length: int, offset: int) -> bytes:
    return read_range(self.path, offset, length, pin=self.info)

  def close(self) -> None:
    """Nothing held open: each range is one request."""


def open_object(path: str, pin: FileInfo | None = None) -> ObjectHandle:
  """An object's handle: pinned to `pin` (a listing's entry: no request), else to what
  one HEAD reports. FileNotFoundError when there is no such object."""
  info = pin if pin is not None and pin.size is not None else file_info(path)
  if info.kind != "file":
    raise FileNotFoundError(f"{path}: no such object ({info.kind})")
  return ObjectHandle(path, info)


class _RangedObject(io.RawIOBase):
  """An `ObjectHandle` as a seekable raw file (for pyarrow's `PythonFile`)."""

  def __init__(self, handle: ObjectHandle, span: tuple[int, int] | None = None):
    super().__init__()
    self._handle, self._size, self._pos = handle, handle.size(), 0
    self._span_at, self._span = 0, b""
    if span is not None and span[1] > 0:  # one request now; reads inside it need none
      self._span_at, self._span = span[0], handle.read_at(span[1], span[0])

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self._pos

  def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
    base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
    self._pos = max(0, base + offset)
    return self._pos

  def readinto(self, buffer) -> int:
    data = self._read(len(buffer))
    buffer[:len(data)] = data
    return len(data)

  def readall(self) -> bytes:
    return self._read(self._size)

  def _read(self, length: int) -> bytes:
    want = min(length, max(0, self._size - self._pos))
    inside = self._pos - self._span_at
    if 0 <= inside and inside + want <= len(self._span):
      data = self._span[inside:inside + want]
    else:
      data = self._handle.read_at(want, self._pos) if want else b""
    self._pos += len(data)
    return data


def open_random_access(path: str, pin: FileInfo | None = None,
                       span: tuple[int, int] | None = None):
  """A seekable pyarrow file (`read_at`, `size`, `seek`, `read`) for parquet footers and
  row groups and index files. On an object store each read is one ranged request of the
  content `pin` (a listing's entry) saw, else of the content its HEAD reported
  (`ObjectHandle`); `span` (offset, length): those bytes are read at once, in one
  request, and the reads inside them make none (a parquet row group's column chunks,
  read together instead of one after the other). Locally, with `pin` as in `read_file`
  (`span` unused: a local read is no round trip)."""
  if _object(path) is None:
    if pin is not None:
      st = os.stat(path)
      _check_pin(path, st.st_size, st.st_mtime_ns, pin)
    return pafs.LocalFileSystem().open_input_file(os.path.abspath(path))
  return pa.PythonFile(_RangedObject(open_object(path, pin), span), mode="r")


def _check_file(path: str, regular: bool, size: int, max_bytes: int | None) -> None:
  if not regular:
    raise FileRefused(f"{path} is not a regular file", regular=False)
  if max_bytes is not None and size > max_bytes:
    raise FileRefused(f"{path}: {size} bytes > {max_bytes}", regular=True)


def _retry(path: str):
  """Each request of a write to `path` is retried on transient faults for up to
  `WRITE_TIMEOUT_S` (the deadline holds inside the request too, as for reads)."""
  policy = storage.RetryPolicy(timeout_s=WRITE_TIMEOUT_S)
  return lambda request: policy.call(path, request)


def _writing(path: str, write) -> None:
  try:
    write()
  except StorageUnavailableError as e:
    raise StorageWriteError(path, e.error, e.waited_s, e.attempts) from e


def write_bytes(path: str, data: bytes) -> None:
  """Writes a whole file; on an object store the object appears only once complete."""
  upload(io.BytesIO(data), len(data), path)


def upload_file(local: str, path: str) -> None:
  """Copies the local file `local` to `path` (an object appears only once complete)."""
  with open(local, "rb") as f:
    upload(f, os.fstat(f.fileno()).st_size, path)


def upload(file, size: int, path: str) -> None:
  """Writes `size` bytes of the seekable binary `file` to `path` (local folders are
  created); an object is sent a part at a time and appears only once complete."""
  remote = _object(path)
  if remote is None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    file.seek(0)
    with open(path, "wb") as out:
      shutil.copyfileobj(file, out, _DOWNLOAD_CHUNK)
    return
  client, bucket, key = remote
  source = UploadSource(file, size, path)
  _writing(path, lambda: client.upload(bucket, key, source, _retry(path)))


def download_file(path: str, local: str) -> None:
  """Copies `path` to the local file `local`: an object in ranged reads of a bounded size,
  each pinned to the object first seen and retried on transient faults."""
  if _object(path) is None:
    shutil.copyfile(path, local)
    return
  retry = _retry(path)
  info = retry(lambda: file_info(path))
  if info.kind != "file":
    raise FileNotFoundError(f"{path}: no such object")
  with open(local, "wb") as out:
    for offset in range(0, int(info.size), _DOWNLOAD_CHUNK):
      out.write(retry(lambda: read_range(path, offset, _DOWNLOAD_CHUNK, info)))  # pylint: disable=cell-var-from-loop


def delete(path: str) -> None:
  """Deletes a file or object; one already gone is no error (a retried delete finds its
  own work done)."""
  remote = _object(path)
  if remote is None:
    if os.path.lexists(path):
      os.remove(path)
    return
  client, bucket, key = remote

  def request() -> None:
    try:
      client.delete(bucket, key)
    except FileNotFoundError:
      pass
  _writing(path, lambda: _retry(path)(request))


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
