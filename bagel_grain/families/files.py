"""Where a record's image and video files come from: the disk under `data_dir`, or the record.

A row names its files by relative path. `DiskFiles` resolves and reads them
through `bagel_grain.fs` and holds the rules for what may be read (a path stays
inside `data_dir`, symlinks out of it included). `EmbeddedFiles` answers from a
converted record, whose files the converter read through `DiskFiles`, recording
each refusal: both stores give the same verdict for the same row.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import IO, Any, Iterable, Iterator, Protocol

from bagel_grain import fs
from bagel_grain.fs import ObjectHandle, open_object
from bagel_grain.drops import Drop, DropReason, require
from bagel_grain.families.base import is_text
from bagel_grain.families.video import order_folder_entries
from bagel_grain.images import DEFAULT_MAX_IMAGE_BYTES
from bagel_grain.ranged_file import RangedFile
from bagel_grain.sources.framing import LineWithFiles
from bagel_grain.sources.readahead import ReadAhead
from bagel_grain.storage import RetryPolicy, is_transient

# A frame folder may hold more entries than a sample takes (it is sampled down), but not
# without bound: a listing of a million keys costs seconds and a gigabyte first.
FOLDER_ENTRIES_PER_FRAME = 16


class FileStore(Protocol):
  """The files a row references. Every method raises `Drop` with the reason to count."""

  def locate(self, relative: Any) -> str:
    """The file (or frame folder, ending in `/`) that a row's relative path names."""

  def read(self, path: str) -> bytes:
    """The bytes of a located file, or of a frame from `list_frames`."""

  def reading(self, paths: Iterable[str]) -> contextlib.AbstractContextManager:
    """A context within which `read` of `paths` may be served by reads started together."""

  def list_frames(self, folder: str, max_frames: int | None = None) -> list[str]:
    """Every file of a located frame folder, in upstream's order (`video.order_folder_entries`);
    a folder of more than `FOLDER_ENTRIES_PER_FRAME * max_frames` entries is dropped
    (`too_many_video_frames`) before it is listed whole."""

  def open_video(self, path: str, max_bytes: int) -> str | IO[bytes]:
    """A located video file of at most `max_bytes` as PyAV opens it, checked before it is read."""


def is_folder(path: str) -> bool:
  return path.endswith("/") or path.endswith(os.sep)


def check_relative(relative: Any) -> None:
  """Drop unless `relative` is a non-empty relative path string."""
  require(is_text(relative) and relative != "", DropReason.WRONG_TYPE,
          "path is not UTF-8 text")
  require(not os.path.isabs(relative) and not fs.is_uri(relative) and "\x00" not in relative,
          DropReason.PATH_OUTSIDE_DATA_DIR, relative)


class DiskFiles:
  """Files under `data_dir`, local or remote (gs://, s3://); nothing outside it is read.

  Every byte comes through `read`, and every video through `open_video`: the one
  place for checks on what a file may be before it is read. Storage's answers
  are sorted there too: a definite one (no such file, not a regular file, too
  large, refused) is a drop with its reason; a transient failure is retried
  (`storage`, by default the read-ahead's) and past the deadline raises
  `StorageUnavailableError`, never a drop.
  """

  def __init__(self, data_dir: str, ahead: ReadAhead | None = None,
               max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
               storage: RetryPolicy | None = None):
    self.data_dir = data_dir
    self.ahead = ahead  # files read ahead under ("file", path), see `sources.readahead`
    self.max_image_bytes = max_image_bytes
    self.storage = storage or (ahead.storage if ahead is not None else RetryPolicy())
    self._together: set[tuple[str, str]] = set()  # started by `reading`, not taken yet

  def locate(self, relative: Any) -> str:
    check_relative(relative)
    path = fs.join(self.data_dir, relative)
    if fs.is_uri(self.data_dir):
      normalised = os.path.normpath(relative)
      require(normalised != ".." and not normalised.startswith("../"),
              DropReason.PATH_OUTSIDE_DATA_DIR, relative)
      return path
    real = os.path.realpath(path)  # follows symlinks: a link out of data_dir is refused too
    require(self._inside(real), DropReason.PATH_OUTSIDE_DATA_DIR, relative)
    return real + (os.sep if is_folder(relative) else "")

  def _inside(self, real: str) -> bool:
    """Whether a resolved local path lies under data_dir (resolved too)."""
    root = os.path.realpath(self.data_dir)
    return real == root or real.startswith(root + os.sep)

  def read(self, path: str) -> bytes:
    """An image's or frame's bytes: only a regular file of at most `max_image_bytes`
    (read ahead through `read_image`, or read now)."""
    if self.ahead is not None and (data := self.ahead.take(("file", path))) is not None:
      self._together.discard(("file", path))
      return data
    return self._read(path, self.max_image_bytes)

  def read_video(self, path: str, max_bytes: int) -> bytes:
    """A whole video file's bytes (for the converter): a regular file of at most `max_bytes`."""
    return self._read(path, max_bytes)

  def _read(self, path: str, max_bytes: int | None) -> bytes:
    try:
      return self.storage.call(path, lambda: fs.read_file(path, max_bytes))
    except fs.FileRefused as e:
      reason = DropReason.FILE_TOO_LARGE if e.regular else DropReason.NOT_A_REGULAR_FILE
      raise Drop(reason, str(e)) from None
    except OSError as e:
      raise _definite(e, path) from None

  def reading(self, paths: Iterable[str]) -> contextlib.AbstractContextManager:
    """Within it, `read` of each of `paths` takes bytes whose reads all started at its
    start (one round trip for a video's frames, not one per frame); those not read by its
    end are forgotten."""
    if self.ahead is None:
      return contextlib.nullcontext()
    return self._reads_together([("file", p) for p in paths])

  @contextlib.contextmanager
  def _reads_together(self, keys: list[tuple[str, str]]):
    for key in dict.fromkeys(keys):
      if self.ahead.start(key, lambda p=key[1]: _sized(fs.read_file(p, self.max_image_bytes))):
        self._together.add(key)
    try:
      yield
    finally:  # what a drop left unread is not held
      self.ahead.forget(self._together)
      self._together = set()

  def list_frames(self, folder: str, max_frames: int | None = None) -> list[str]:
    bound = fs.MAX_LIST_ENTRIES if max_frames is None else FOLDER_ENTRIES_PER_FRAME * max_frames
    listed = self.ahead.take(("list", folder)) if self.ahead is not None else None
    # The read-ahead's verdict that the folder holds more than its bound: ours too when ours
    # is no larger, so its pages are not listed again.
    too_many = isinstance(listed, fs.ListingTooLong) and listed.bound >= bound
    listed = None if isinstance(listed, fs.ListingTooLong) else listed
    try:
      if listed is None and not too_many:
        listed = self.storage.call(folder, lambda: fs.list_files(folder, max_entries=bound))
    except fs.ListingTooLong:
      listed = None
    except OSError as e:
      raise _definite(e, f"video folder {folder}") from None
    require(listed is not None and len(listed) <= bound, DropReason.TOO_MANY_VIDEO_FRAMES,
            f"video folder {folder} holds more than {bound} entries "
            f"({FOLDER_ENTRIES_PER_FRAME} x max_video_frames = {max_frames})")
    frames = order_folder_entries(listed)
    if not fs.is_uri(folder):  # a frame may link to another folder of data_dir, not out of it
      for path in frames:
        require(self._inside(os.path.realpath(path)), DropReason.PATH_OUTSIDE_DATA_DIR,
                f"frame {path} links out of data_dir {self.data_dir}")
    return frames

  def open_video(self, path: str, max_bytes: int) -> str | RangedFile:
    """A local file's path (PyAV opens it), or an object as a `RangedFile`: its size
    checked from the handle's open (one HEAD), its bytes read in ranges as PyAV asks."""
    if fs.is_uri(path):
      return self._open_object(path, max_bytes)
    try:  # only a regular file is opened: opening a FIFO would wait forever
      info = self.storage.call(path, lambda: fs.file_info(path))
    except OSError as e:
      raise _definite(e, path) from None
    kind = fs.kind_of(info)
    require(kind != "missing", DropReason.MISSING_FILE, path)
    require(kind == "file", DropReason.NOT_A_REGULAR_FILE, f"{path} is a {kind}")
    size = info.size  # checked before PyAV reads a byte
    require(size <= max_bytes, DropReason.FILE_TOO_LARGE,
            f"{path}: {size} bytes > max_video_bytes = {max_bytes}")
    return path  # PyAV opens the path itself

  def _open_object(self, path: str, max_bytes: int) -> RangedFile:
    """The object's size and head from the read-ahead (no request when the head is the
    whole clip), else from opening it (one request); its other bytes read in ranges."""
    head = self.ahead.take(("video", path)) if self.ahead is not None else None
    info, data = head if head is not None else (None, b"")
    ranges = _ObjectRanges(path, self.storage, info)
    try:
      size = ranges.size()
      require(size <= max_bytes, DropReason.FILE_TOO_LARGE,
              f"{path}: {size} bytes > max_video_bytes = {max_bytes}")
    except BaseException:
      ranges.close()
      raise
    return RangedFile(path, size, ranges.read, head=data, close=ranges.close)


class _ObjectRanges:
  """Ranged reads of one object through one handle, opened on first need (or made from the
  identity the read-ahead saw, so that the head and the ranges are of one content), each
  read retried under the storage policy; storage's definite answers become drops."""

  def __init__(self, path: str, storage: RetryPolicy, info: fs.FileInfo | None = None):
    self.path, self.storage = path, storage
    self.handle = None if info is None else ObjectHandle(path, info)

  def _handle(self) -> ObjectHandle:
    if self.handle is None:
      self.handle = self.storage.call(self.path, lambda: open_object(self.path))
    return self.handle

  def size(self) -> int:
    try:
      return self._handle().size()
    except OSError as e:
      raise _definite(e, self.path) from None

  def read(self, offset: int, length: int) -> bytes:
    try:
      handle = self._handle()
      data = self.storage.call(self.path, lambda: handle.read_at(length, offset))
    except fs.ObjectChanged as e:
      raise Drop(DropReason.UNREADABLE_FILE, f"{e}; it changed while a sample read it") from None
    except OSError as e:
      raise _definite(e, self.path) from None
    require(len(data) == length, DropReason.UNREADABLE_FILE,
            f"{self.path}: {len(data)} bytes at {offset}, not {length}: the object changed "
            "while it was read")
    return data

  def close(self) -> None:
    if self.handle is not None:
      self.handle.close()
      self.handle = None


@contextlib.contextmanager
def opened_video(files: FileStore, path: str, max_bytes: int) -> Iterator[str | IO[bytes]]:
  """`files.open_video`, closed on exit when it is a file object (a path has nothing open)."""
  source = files.open_video(path, max_bytes)
  try:
    yield source
  finally:
    if not isinstance(source, str):
      source.close()


def _sized(data: bytes) -> tuple[bytes, int]:
  return data, len(data)


def _definite(error: OSError, what: str) -> Exception:
  """The drop for storage's definite answer about a file (a transient failure is raised
  as it is: only a read ahead, which tries once, lets one through)."""
  if is_transient(error):
    return error
  if isinstance(error, FileNotFoundError):
    return Drop(DropReason.MISSING_FILE, f"{what}: {error}")
  return Drop(DropReason.FILE_NOT_READABLE, f"{what}: {error}")


class EmbeddedFiles:
  """The files a converted record carries, under the relative paths its row spells.

  A path the converter's `DiskFiles` refused is in `file_errors` with the reason;
  nothing here touches the disk, so nothing can leave `data_dir`.
  """

  def __init__(self, record: LineWithFiles):
    self.record = record

  def locate(self, relative: Any) -> str:
    check_relative(relative)
    if relative in self.record.file_errors:
      raise Drop(self.record.file_errors[relative], relative)
    return relative

  def read(self, path: str) -> bytes:
    if path not in self.record.files:
      raise Drop(self.record.file_errors.get(path, DropReason.MISSING_FILE), path)
    return self.record.files[path]

  def reading(self, paths: Iterable[str]) -> contextlib.AbstractContextManager:
    """Nothing to start: the record carries its files."""
    del paths
    return contextlib.nullcontext()

  def list_frames(self, folder: str, max_frames: int | None = None) -> list[str]:
    del max_frames  # the record holds what the converter listed, within its bound
    names = [*self.record.files, *self.record.file_errors]  # an unreadable frame counts too
    inside = [name for name in names
              if name.startswith(folder) and "/" not in name[len(folder):]]
    return order_folder_entries(inside)

  def open_video(self, path: str, max_bytes: int) -> IO[bytes]:
    require(path in self.record.files, DropReason.MISSING_FILE, path)
    data = self.record.files[path]
    require(len(data) <= max_bytes, DropReason.FILE_TOO_LARGE,
            f"{path}: {len(data)} bytes > max_video_bytes = {max_bytes}")
    return io.BytesIO(data)
