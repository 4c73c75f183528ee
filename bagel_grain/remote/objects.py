"""What an object store says about an object, and listings that cannot run away.

`FileInfo` is one listing entry (local files have one too, see `bagel_grain.fs`):
size and time, and the identity of the content as the store reports it (an S3
ETag, a GCS generation, crc32c and MD5). `collect_pages` walks a paginated
listing with bounds: at most `max_entries` entries (past it `ListingTooLong`,
a definite answer: the folder is larger than its reader accepts), and a
continuation token seen before, or a page whose keys go back, is
`BadListing` (a store that would page forever), never a loop.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Callable

from bagel_grain.remote.http import DefiniteError

MAX_LIST_ENTRIES = 1_000_000  # files in one folder, unless the caller bounds it lower


@dataclasses.dataclass(frozen=True)
class FileInfo:
  """One path as its storage reports it.

  `kind` is "file", "folder", "missing" or "special file" (FIFO, device, socket).
  `etag`, `generation`, `md5` (hex) and `crc32c` (8 hex digits) are what an
  object store reports (None where it reports nothing: always on local disk);
  `generation` is the GCS generation or the S3 version id. `probe` (local files, as a
  pin): (kind, SHA-256) of the bytes that stand for the content (`bagel_grain.fs.probe`),
  as the build knew them, so a pinned read of a file whose time changed compares content.
  """

  path: str
  kind: str
  size: int | None = None
  mtime_ns: int | None = None
  etag: str | None = None
  generation: str | None = None
  md5: str | None = None
  crc32c: str | None = None
  probe: tuple[str, str] | None = None

  @property
  def base_name(self) -> str:
    return posixpath.basename(self.path.rstrip("/").replace("\\", "/"))

  @property
  def is_file(self) -> bool:
    return self.kind == "file"

  @property
  def content_id(self) -> str | None:
    """What the store says the bytes are, independent of when they were written: the
    MD5 where known, else the crc32c and size (GCS composite objects), else the ETag
    (S3 multipart); None on local disk."""
    if self.md5:
      return f"md5:{self.md5}"
    if self.crc32c:
      return f"crc32c:{self.crc32c}:{self.size}"
    if self.etag:
      return f"etag:{self.etag}"
    return None


class ListingError(DefiniteError):
  """A listing refused: too many entries, or a store that pages in circles."""


class ListingTooLong(ListingError):
  def __init__(self, message: str, bound: int):
    super().__init__(message)
    self.bound = bound


class BadListing(ListingError):
  pass


Page = tuple[list[FileInfo], str | None]  # a page's files, and the token of the next page


def collect_pages(fetch: Callable[[str | None], Page], where: str,
                  max_entries: int = MAX_LIST_ENTRIES) -> list[FileInfo]:
  """The files of every page `fetch(token)` gives, from the first (token None)."""
  files: list[FileInfo] = []
  seen: set[str] = set()
  token, last = None, None
  while True:
    page, token = fetch(token)
    if page and last is not None and page[0].path <= last:
      raise BadListing(f"the listing of {where} went back to {page[0].path} after {last} "
                       "(a store that pages in circles); not read")
    files.extend(page)
    last = page[-1].path if page else last
    if len(files) > max_entries:
      raise ListingTooLong(f"{where} holds more than {max_entries} files", max_entries)
    if not token:
      return files
    if token in seen:
      raise BadListing(f"the listing of {where} repeated its continuation token after "
                       f"{len(seen) + 1} pages (a store that pages in circles); not read")
    seen.add(token)
    if len(seen) > max_entries // 10 + 100:
      raise BadListing(f"the listing of {where} took more than {len(seen)} pages for "
                       f"{len(files)} files; not read")
