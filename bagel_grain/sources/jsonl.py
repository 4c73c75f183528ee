"""Random access to JSONL lines through a byte-offset index (the file is never held whole,
but a small object, read whole at build in the request its scan makes: `whole_objects`).

Every process reads the file as the build found it, or not at all. Each process
opens it itself (a worker on its first line), so a file deleted, replaced or
rewritten while the stream runs would otherwise give each process whatever it
opened: the main process kept reading a deleted file through its open handle
while workers, opening it afresh, found nothing. Instead, every read is of the
file the build saw. An object is identified as its store reports it (its `FileInfo`
at build: S3 ETag, GCS generation and checksums) and every line is read pinned to
it (`fs.open_random_access(pin=)`), so an identical re-upload (same bytes, a new
upload time) reads on and anything else is refused. A local file is checked to be
the one the build saw when opened and again at every line (deleted, or changed
since: its size, or at the same size a new time and other first or last MiB). The
lines of a file that changed are dropped as `unreadable_file` naming it, whatever
the worker count.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import os
import threading
import time

import numpy as np

from bagel_grain import fs
from bagel_grain.drops import Drop, DropReason
from bagel_grain.sources import sidecar, whole_objects

_LOADING = threading.Lock()  # a source is loaded once, whichever thread reads it first


class JsonlLineSource:
  """Lines of one JSONL file as raw bytes (parsing happens in the family transform).

  `num_used` and `shuffle_lines`/`shuffle_seed` keep upstream's meaning: the
  line list is shuffled with `random.Random(shuffle_seed)` (the same permutation
  upstream's shuffle of `readlines()` makes), then cut. Line offsets come from the
  sidecar index when there is one (see `sidecar`), else from a scan.

  Building costs nothing per line; the lines a source serves are loaded on first
  use, or by `restrict(first, last)` (positions [first, last) only, what one
  process's shard needs): 16 bytes a line (line number, start, length).
  """

  def __init__(self, path: str, *, num_used: int | None = None, shuffle_lines: bool = False,
               shuffle_seed: int = 0):
    self._path = path
    content = None  # a small object's bytes, of `stamp`: its scan's, tail's and lines'
    if fs.is_uri(path):  # the object, its index stamp and its tail: requests made together
      with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="bagel-grain-jsonl") as pool:
        index_stamp = pool.submit(sidecar.read_line_index_stamp, path)
        stamp = _stamp(path)  # before the scan: a change during it shows too
        whole = int(stamp.size) <= whole_objects.OBJECT_BYTES
        if whole:
          content = _read_whole(path, stamp)
        else:
          tail = pool.submit(tail_digest, path, int(stamp.size), stamp)
        self._index: sidecar.LineIndex | None = sidecar.LineIndex(
            path, stamp, index_stamp.result, content=content)
        if not whole:
          self.tail = tail.result()
        else:  # as `tail_digest` says of an object changed since its HEAD: None
          self.tail = None if content is None else _tail(content, len(content))
    else:
      stamp = _stamp(path)
      self._index = sidecar.LineIndex(path, stamp)
      self.tail = tail_digest(path, int(stamp.size))
    self.size = int(stamp.size)  # the bytes its lines are read from (the manifest's)
    known = self._index.identity  # the index's probe, else this file's now
    # The content checksum its index records (the manifest's), None without one.
    self.indexed_checksum = (known.checksum() or None) if known is not None else None
    self._stamp = (dataclasses.replace(stamp, probe=("jsonl", known.probe))
                   if known is not None and known.probe and not fs.is_uri(path)
                   else fs.with_probe(stamp, "jsonl"))
    count = self._index.count if num_used is None else min(num_used, self._index.count)
    self._seed = shuffle_seed if shuffle_lines else None
    self._span = (0, count)
    self._line = self._start = self._length = None
    self._file = None
    # A small object's lines are served from its bytes (on a bucket no round trip for them
    # before the first batch), within the process's budget: this source's own copy.
    self._content = content if content is not None and whole_objects.HELD.reserve(
        {object(): len(content)}) else None

  def _load(self) -> None:
    if self._length is not None:  # set last: the arrays are all there
      return
    with _LOADING:
      if self._length is not None:
        return
      first, last = self._span
      if self._seed is None:
        lines = np.arange(first, last, dtype=np.int64)
      else:
        lines = self._index.order(self._seed, first, last)
      starts, lengths = self._index.spans(lines)
      small = self._index.count < 2**31
      self._line = lines.astype(np.int32 if small else np.int64)
      self._start = starts
      self._index = None  # shared with the source it was restricted from: not closed here
      self._length = lengths.astype(np.uint32 if len(lengths) == 0 or lengths.max() < 2**32
                                    else np.int64)

  def num_blocks(self) -> int:
    return self._span[1] - self._span[0]

  def restrict(self, first: int, last: int) -> JsonlLineSource:
    """The lines at positions [first, last) of this source, loaded."""
    if (first, last) == (0, self.num_blocks()):
      return self
    part = JsonlLineSource.__new__(JsonlLineSource)
    part.__dict__.update(self.__dict__)
    part._span = (self._span[0] + first, self._span[0] + last)
    part._file = None
    if self._length is None:
      part._load()
    else:  # loaded already: its index is gone, cut the arrays
      part._line, part._start, part._length = (a[first:last] for a in (
          self._line, self._start, self._length))
    return part

  def line_offset(self, position: int) -> int:
    """The byte where the line at `position` starts (of a source not shuffled)."""
    part = self.restrict(position, position + 1)
    part._load()  # pylint: disable=protected-access
    return int(part._start[0])  # pylint: disable=protected-access

  @property
  def path(self) -> str:
    return self._path

  def grown_from(self, lines: int) -> JsonlLineSource:
    """The file read on from when it had `lines` lines: those first, in the order the
    source had then (`shuffle_lines` shuffles `lines` lines), then the lines appended
    since, in file order. Loaded."""
    index = self._index if self._index is not None else sidecar.LineIndex(self._path)
    if not 0 < lines <= index.count:
      raise ValueError(f"{self._path} has {index.count} lines, not {lines} or more")
    before = (np.arange(lines, dtype=np.int64) if self._seed is None
              else sidecar.upstream_line_order(lines, self._seed).astype(np.int64))
    order = np.concatenate([before, np.arange(lines, index.count, dtype=np.int64)])
    starts, lengths = index.spans(order)
    part = JsonlLineSource.__new__(JsonlLineSource)
    part.__dict__.update(self.__dict__)
    part._span, part._file, part._index = (0, len(order)), None, None
    part._line = order.astype(np.int32 if index.count < 2**31 else np.int64)
    part._start = starts
    part._length = lengths.astype(np.uint32 if len(lengths) == 0 or lengths.max() < 2**32
                                  else np.int64)
    return part

  @property
  def shuffled(self) -> bool:
    """Whether lines are read in a shuffled order (`shuffle_lines`)."""
    return self._seed is not None

  def __getstate__(self):
    self._load()  # workers get the arrays, never the index
    state = self.__dict__.copy()
    state["_file"] = None
    return state

  def __len__(self) -> int:
    return self.num_blocks()

  def block_sizes(self) -> np.ndarray:
    return np.ones(len(self), np.int64)  # every record is its own block

  def record_id(self, index: int) -> str:
    self._load()
    return f"{self._path}:{int(self._line[index]) + 1}"

  def record_bytes(self, index: int) -> int:
    """A line's length from its offsets, unread (read-ahead admits a read by it)."""
    self._load()
    return int(self._length[index])

  def line_lengths(self) -> np.ndarray:
    """Every line's length in bytes, in source order, unread (from the offsets)."""
    self._load()
    return self._length

  def __getitem__(self, index: int) -> bytes:
    self._load()
    if self._content is not None:
      start = int(self._start[index])
      data = self._content[start:start + int(self._length[index])]
      return data[:-1] if data.endswith(b"\r") else data
    if self._file is None:
      self._file = _open_checked(self._path, self._stamp)
    try:
      data = self._file.read_at(int(self._length[index]), int(self._start[index]))
    except fs.ObjectChanged as e:
      raise Drop(DropReason.UNREADABLE_FILE,
                 f"{e}; it changed since the stream was built: its lines are not read") from None
    return data[:-1] if data.endswith(b"\r") else data


TAIL_BYTES = 4096


def _read_whole(path: str, stamp: fs.FileInfo) -> bytes | None:
  """The object's bytes as `stamp` saw them (one request); None when they changed since."""
  try:
    return fs.read_range(path, 0, int(stamp.size), pin=stamp)
  except fs.ObjectChanged:
    return None


def _tail(data: bytes, size: int) -> str:
  """The digest `tail_digest` makes of `data`, the file's bytes up to `size`."""
  return hashlib.sha256(data[max(0, size - TAIL_BYTES):size]).hexdigest()[:16]


def tail_digest(path: str, size: int, pin: fs.FileInfo | None = None) -> str | None:
  """A digest of the file's bytes [size - TAIL_BYTES, size): the end of the lines a JSONL
  held at `size` bytes, read again when it has grown. With `pin`, of the content the pin
  saw; None when that content is gone (its lines are dropped, as the stream's reads find)."""
  start = max(0, size - TAIL_BYTES)
  try:
    data = fs.read_range(path, start, size - start, pin=pin) if fs.is_uri(path) else None
  except fs.ObjectChanged:
    return None
  if data is None:
    with fs.open_random_access(path) as f:
      data = f.read_at(size - start, start)
  return _tail(data, len(data))


def _stamp(path: str) -> fs.FileInfo:
  """What tells the file the build saw: an object's `FileInfo` (its reads are pinned to
  it), a local file's size and modification time, and its probe (see `_LocalLines`)."""
  if fs.is_uri(path):
    return fs.file_info(path)
  st = os.stat(path)
  return fs.FileInfo(os.path.abspath(path), "file", st.st_size, st.st_mtime_ns)


def _open_checked(path: str, indexed: fs.FileInfo):
  """The file opened for reading by offset, if it is still the one indexed; else Drop.

  An object's lines are ranged reads pinned to the listing (each read checked by the
  store: no request of ours), one request a line, each on its own: the read-ahead
  threads read many lines of one file at once (`fs.ObjectHandle`: not pyarrow's
  `PythonFile`, whose lock sent them one at a time).
  """
  if fs.is_uri(path):
    return fs.ObjectHandle(path, indexed)
  return _LocalLines(path, indexed)


class _LocalLines:
  """A local JSONL file read with `pread`, checked to be the one the build saw.

  On a local file system one `fstat` a line (about 10 us in Python) tells a deleted
  file (no link left) or one rewritten in place: another size, or the same size and
  another time with other first or last MiB (`fs.pin_differs`: an identical file
  with a new time, a `touch` or an upload seen through a mount, reads on; its probe
  is read once per new time). On a network or FUSE mount (gcsfuse,
  NFS) an `fstat` may be a metadata request to the server once its cache lapses
  (gcsfuse with a stat TTL of 0: every one), tens of milliseconds a line: there the
  file is checked when opened and then at most once every `MOUNT_CHECK_S`, so a change
  is seen within that time. The descriptor closes with the object.
  """

  def __init__(self, path: str, indexed: fs.FileInfo):
    self._path, self._indexed = path, indexed
    self._file = io.FileIO(path, "r")
    self._every_s = MOUNT_CHECK_S if on_network_mount(path) else 0.0
    self._checked = 0.0
    self._check()

  def _check(self) -> None:
    if self._every_s:
      now = time.monotonic()
      if now - self._checked < self._every_s:
        return
      self._checked = now
    st = os.fstat(self._file.fileno())
    if st.st_nlink == 0:
      raise Drop(DropReason.UNREADABLE_FILE,
                 f"{self._path} was deleted while the stream ran: its lines are not read")
    why = fs.pin_differs(self._path, st.st_size, st.st_mtime_ns, self._indexed)
    if why:
      raise Drop(DropReason.UNREADABLE_FILE, f"{self._path} changed since the stream was "
                 f"built ({why}): its lines are not read")

  def read_at(self, nbytes: int, offset: int) -> bytes:
    self._check()
    return os.pread(self._file.fileno(), nbytes, offset)


MOUNT_CHECK_S = 1.0
# File system types whose metadata lives on a server: a stat may be a request.
_NETWORK_TYPES = ("nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre", "gpfs",
                  "fuse.gcsfuse", "fuse.s3fs", "fuse.rclone", "fuse.goofys", "fuse.mountpoint-s3",
                  "fuse.blobfuse2", "fuse.sshfs", "fuse.juicefs", "fuse.alluxio-fuse")


def on_network_mount(path: str) -> bool:
  """Whether `path` lies on a network or object-store mount (Linux's mount table; False
  where there is none to read)."""
  real = os.path.realpath(path)
  best, kind = "", ""
  for point, fstype in _mounts():
    if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
      best, kind = point, fstype
  return kind in _NETWORK_TYPES


def _mounts() -> list[tuple[str, str]]:
  """(mount point, file system type) of this process's mounts, from /proc/self/mountinfo."""
  try:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
      lines = f.read().splitlines()
  except OSError:
    return []
  out = []
  for line in lines:
    fields = line.split(" ")
    if " - " in line and len(fields) > 4:
      after = line.split(" - ", 1)[1].split(" ")
      point = fields[4].encode().decode("unicode_escape")  # spaces are written \040
      out.append((point, after[0]))
  return out
