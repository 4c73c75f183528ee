"""What identifies a data file: its size and its content's checksums, never its time.

An index (and a saved state) must know its files wherever they now lie: `cp -r`
gives every file a new time, an upload the upload's time, a bucket-to-bucket copy
a new generation; none of them changes a byte. So the index records each file's
size and checksums of its whole content (MD5 and CRC32C, computed when it is
indexed from local disk or a mount, taken from the listing when it is indexed in a
bucket), and a build compares them with what the storage reports now:

- GCS lists each object's CRC32C (and its MD5 unless it was composed);
- S3 lists an ETag: the MD5 of the content for a single-part upload, and for a
  multipart one the MD5 of its parts' MD5s; the index also records that ETag for
  8 MiB parts (what `aws s3 cp/sync` and boto3 use), so their uploads compare;
- local disk and mounts list a size and a time only: a file at the size and time
  the index recorded is trusted; one whose time differs (a copy) is checked by its
  probe, a SHA-256 of a few bytes read from it (a parquet file's footer, a JSONL
  file's first and last MiB), and `bagel-grain index --verify` reads it whole.

A probe sees what changes a footer (rows, row groups, column statistics, page
offsets and sizes) or a JSONL file's ends; it cannot see a rewrite that keeps all
of those, e.g. an image's bytes replaced by others of the same length in a column
without statistics: `--verify` sees that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Callable

import google_crc32c

from bagel_grain import fs
from bagel_grain.fs import PROBE_BYTES, probe  # noqa: F401  (what an index records)

S3_PART_BYTES = 8 << 20  # the AWS CLI's and boto3's multipart threshold and part size
_READ_BYTES = S3_PART_BYTES


@dataclasses.dataclass(frozen=True)
class Identity:
  """One file as an index records it, or as a listing reports it now ("" = not known)."""

  size: int
  mtime_ns: int = 0  # where it was indexed or verified: a shortcut for local disk only
  md5: str = ""  # hex digests of the whole content
  crc32c: str = ""
  etag: str = ""  # an S3 multipart ETag ("hex-N"); a single-part ETag is the md5
  probe: str = ""  # SHA-256 of the probe bytes (an index's side only)

  def multipart_etags(self) -> set[str]:
    """The S3 ETags of multipart uploads of this content that the index can tell: in
    8 MiB parts, and in one part (what pyarrow's S3 writer sends for a small file)."""
    one_part = {f"{hashlib.md5(bytes.fromhex(self.md5)).hexdigest()}-1"} if self.md5 else set()
    return one_part | ({self.etag} if self.etag else set())

  def checksum(self) -> str:
    """The content's name in a saved state: `md5:HEX`, else `crc32c:HEX`, else ""."""
    if self.md5:
      return f"md5:{self.md5}"
    return f"crc32c:{self.crc32c}" if self.crc32c else ""


_MULTIPART_ETAG = re.compile(r"[0-9a-f]{32}-[0-9]+")


def of_listing(info: fs.FileInfo) -> Identity:
  """A listing's entry (`fs.FileInfo`) as an identity: size, time, and the checksums the
  store reports (an S3 single-part ETag is reported as the MD5 already)."""
  etag = (info.etag or "").strip('"').lower()
  return Identity(int(info.size or 0), int(info.mtime_ns or 0), md5=(info.md5 or "").lower(),
                  crc32c=(info.crc32c or "").lower(),
                  etag=etag if _MULTIPART_ETAG.fullmatch(etag) else "")


def compare(indexed: Identity, now: Identity) -> tuple[bool | None, str]:
  """(same?, why): False on any checksum or size that differs, True on one that agrees
  (or on local disk, the same size and time), None when nothing comparable is known."""
  if indexed.size != now.size:
    return False, f"size {now.size}, indexed {indexed.size}"
  agreed = ""
  for kind in ("md5", "crc32c"):
    before, after = getattr(indexed, kind), getattr(now, kind)
    if before and after:
      if before != after:
        return False, f"same size, {kind} {after}, indexed {before}"
      agreed = agreed or f"{kind} agrees"
  if now.etag and now.etag in indexed.multipart_etags():
    agreed = agreed or "etag agrees"  # another part size's ETag differs: it tells nothing
  if agreed:
    return True, agreed
  if indexed.mtime_ns and indexed.mtime_ns == now.mtime_ns:
    return True, "size and time agree"
  return None, "its time differs from the index's and its storage lists no checksum"


def verified(indexed: Identity, now: Identity, read: Identity) -> tuple[bool, Identity]:
  """(same content?, what the index records from now on) for a file whose content `read`
  (`content`) was compared with the index: the checksums it lacked (an index written on
  S3 knew a multipart ETag only), its new time and its listed ETag (another part size's),
  so a build compares them without reading."""
  checks = [getattr(read, k) == getattr(indexed, k) for k in ("md5", "crc32c")
            if getattr(indexed, k)]
  if not checks and indexed.etag:  # the ETags this content has in 8 MiB parts, or in one
    checks = [indexed.etag in read.multipart_etags()]
  same = read.size == indexed.size and bool(checks) and all(checks)
  return same, dataclasses.replace(indexed, mtime_ns=now.mtime_ns, etag=now.etag or indexed.etag,
                                   md5=indexed.md5 or read.md5,
                                   crc32c=indexed.crc32c or read.crc32c)


def content(path: str, progress: Callable[[int], object] | None = None) -> Identity:
  """The file's size, MD5, CRC32C and 8 MiB-part S3 ETag, from one read of it."""
  info = fs.file_info(path)
  md5, crc, parts = hashlib.md5(), google_crc32c.Checksum(), []
  size = 0
  with fs.open_random_access(path, pin=info) as f:
    while True:
      chunk = f.read_at(_READ_BYTES, size)
      if not chunk:
        break
      md5.update(chunk)
      crc.update(chunk)
      parts.append(hashlib.md5(chunk).digest())
      size += len(chunk)
      if progress:
        progress(len(chunk))
  etag = ""
  if size >= S3_PART_BYTES:
    etag = f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"
  return Identity(size, int(info.mtime_ns or 0), md5=md5.hexdigest(),
                  crc32c=crc.digest().hex(), etag=etag)


def indexed(path: str, listed: Identity, kind: str,
            progress: Callable[[int], object] | None = None) -> Identity:
  """What an index records of the file `listed` describes: the listing's checksums when
  the storage gives them (no read; on S3 a multipart upload's ETag only, which a copy
  keeps and another store's listing cannot check), else the content's (one read), and
  its probe."""
  whole = listed if (listed.md5 or listed.crc32c or listed.etag) else content(path, progress)
  return dataclasses.replace(whole, mtime_ns=listed.mtime_ns, probe=probe(path, kind))
