"""Google Cloud Storage's JSON API over `remote.http`: list, metadata, media reads, uploads
and deletes.

Credentials: with `STORAGE_EMULATOR_HOST` (an emulator) none. Otherwise an OAuth
token from `GOOGLE_OAUTH_ACCESS_TOKEN`, else from google-auth's default credentials
when that package is installed, else from the metadata server (GCE and TPU VMs).

Listings report each object's `generation`, `crc32c` and `md5Hash` (absent for
composite objects). A read pinned to a listing's entry asks for that generation;
if the store no longer has it (a new upload), the current object is read only
when its crc32c and MD5 equal the pin's (an identical re-upload), else
`http.PreconditionFailed`.

An object is written whole (`upload`): up to `PART_BYTES` in one media upload, a
larger one as a resumable upload sent `PART_BYTES` at a time from its file (one
chunk in memory). Each request is passed to the caller's `retry` on its own; after
a failed chunk the session is asked how much it holds, and the upload goes on from
there. The MD5 the store reports for the finished object must be that of the bytes
sent (`UploadCorrupted` otherwise).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import threading
import time
import urllib.parse

from bagel_grain.remote import http
from bagel_grain.remote.objects import FileInfo, Page, collect_pages
from bagel_grain.remote.writes import Retry, UploadCorrupted, UploadSource

LIST_PAGE_BYTES = 16 << 20
PART_BYTES = 16 << 20  # a resumable upload's chunks: a multiple of 256 KiB
_ANSWER_BYTES = 1 << 20  # the answer to a write: an object's metadata
_METADATA_TOKEN = ("http://metadata.google.internal/computeMetadata/v1/instance/"
                   "service-accounts/default/token")
_OBJECT_FIELDS = "name,size,updated,generation,crc32c,md5Hash,etag"
_FIELDS = f"items({_OBJECT_FIELDS}),prefixes,nextPageToken"


class GCSClient:
  def __init__(self, env: dict[str, str | None]):
    host = env.get("STORAGE_EMULATOR_HOST")
    self.emulated = bool(host)
    if host:
      self.base = (host if "://" in host else "http://" + host).rstrip("/")
    else:
      self.base = "https://storage.googleapis.com"
    self._token: tuple[str, float] | None = None
    self._lock = threading.Lock()

  def _headers(self) -> dict[str, str]:
    if self.emulated:
      return {}
    with self._lock:
      if self._token is None or self._token[1] < time.time() + 60:
        self._token = _fetch_token()
      return {"Authorization": f"Bearer {self._token[0]}"}

  def _object_url(self, bucket: str, key: str, query: dict[str, str]) -> str:
    name = urllib.parse.quote(key, safe="")
    return (f"{self.base}/storage/v1/b/{bucket}/o/{name}?"
            + urllib.parse.urlencode(query))

  def list(self, bucket: str, prefix: str, max_entries: int) -> list[FileInfo]:
    def page(token: str | None) -> Page:
      query = {"prefix": prefix, "delimiter": "/", "fields": _FIELDS, "maxResults": "1000"}
      if token:
        query["pageToken"] = token
      url = f"{self.base}/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(query)
      answer = json.loads(http.request("GET", url, self._headers()).read(LIST_PAGE_BYTES))
      files = [_info(bucket, item) for item in answer.get("items") or []
               if not item["name"].endswith("/")]
      return files, answer.get("nextPageToken")
    return collect_pages(page, f"gs://{bucket}/{prefix}", max_entries)

  def has_children(self, bucket: str, prefix: str) -> bool:
    query = {"prefix": prefix, "maxResults": "1", "fields": "items(name),prefixes"}
    url = f"{self.base}/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(query)
    answer = json.loads(http.request("GET", url, self._headers()).read(LIST_PAGE_BYTES))
    return bool(answer.get("items") or answer.get("prefixes"))

  def head(self, bucket: str, key: str) -> FileInfo:
    url = self._object_url(bucket, key, {"fields": _OBJECT_FIELDS})
    return _info(bucket, json.loads(http.request("GET", url, self._headers()).read(1 << 20)))

  def get(self, bucket: str, key: str, *, max_bytes: int, first: int = 0,
          last: int | None = None, pin: FileInfo | None = None) -> bytes:
    headers = self._headers()
    if first or last is not None:
      headers["Range"] = f"bytes={first}-{'' if last is None else last}"
    query = {"alt": "media"}
    if pin is not None and pin.generation:
      query["generation"] = pin.generation
    try:
      response = http.request("GET", self._object_url(bucket, key, query), headers)
    except FileNotFoundError:
      if pin is None or not pin.generation:
        raise
      now = self.head(bucket, key)  # raises FileNotFoundError if it is gone altogether
      if not _same_content(now, pin):
        raise http.PreconditionFailed(
            f"gs://{bucket}/{key}: generation {now.generation} holds other bytes than "
            f"generation {pin.generation}") from None
      return self.get(bucket, key, max_bytes=max_bytes, first=first, last=last, pin=now)
    _check_generation(response, pin, f"gs://{bucket}/{key}")
    return response.read(max_bytes)


  def delete(self, bucket: str, key: str) -> None:
    """Deletes an object; `FileNotFoundError` if there is none."""
    http.request("DELETE", self._object_url(bucket, key, {}), self._headers()).read(_ANSWER_BYTES)

  def upload(self, bucket: str, key: str, source: UploadSource, retry: Retry) -> None:
    """Writes `source` as the object; it appears only once whole."""
    where = f"gs://{bucket}/{key}"
    query = {"name": key}
    if source.size <= PART_BYTES:
      data = source.read(0, source.size)
      url = self._upload_url(bucket, {"uploadType": "media", **query})
      answer = retry(lambda: http.request("POST", url, self._headers(), data).read(_ANSWER_BYTES))
      _check_md5(answer, hashlib.md5(data).digest(), where)
      return
    url = self._upload_url(bucket, {"uploadType": "resumable", **query})
    session = retry(lambda: self._start_session(url, source.size, where))
    md5 = hashlib.md5()
    hashed, offset, answer, lost = 0, 0, None, False

    def step() -> tuple[int, bytes | None]:
      nonlocal lost
      if lost:  # the last chunk failed: how much of it the session holds
        done = self._send_chunk(session, offset, b"", source.size)
        lost = False
        return done
      data = source.read(offset, min(PART_BYTES, source.size - offset))
      try:
        return self._send_chunk(session, offset, data, source.size)
      except Exception:
        lost = True
        raise

    while answer is None:
      offset, answer = retry(step)
      while hashed < offset:  # the bytes the session holds, hashed once each
        chunk = source.read(hashed, min(PART_BYTES, offset - hashed))
        md5.update(chunk)
        hashed += len(chunk)
    _check_md5(answer, md5.digest(), where)

  def _upload_url(self, bucket: str, query: dict[str, str]) -> str:
    return f"{self.base}/upload/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(query)

  def _start_session(self, url: str, size: int, where: str) -> str:
    headers = {**self._headers(), "Content-Type": "application/json; charset=UTF-8",
               "X-Upload-Content-Length": str(size)}
    response = http.request("POST", url, headers, b"{}")
    session = response.headers.get("location", "")
    response.read(_ANSWER_BYTES)
    ours, theirs = urllib.parse.urlsplit(self.base), urllib.parse.urlsplit(session)
    if (theirs.scheme, theirs.netloc) != (ours.scheme, ours.netloc):
      raise http.RedirectRefused(f"{where}: the resumable upload's session is on "
                                 f"{theirs.netloc or 'no host'}, not {ours.netloc}; not used "
                                 "(the request's credentials would go along)")
    return session

  def _send_chunk(self, session: str, offset: int, data: bytes,
                  size: int) -> tuple[int, bytes | None]:
    """Sends `data` from `offset` (no data: asks the session's state); (the bytes the
    session holds, the finished object's metadata or None while it is incomplete)."""
    span = f"{offset}-{offset + len(data) - 1}" if data else "*"
    headers = {**self._headers(), "Content-Range": f"bytes {span}/{size}"}
    response = http.request("PUT", session, headers, data, accept=frozenset({308}))
    body = response.read(_ANSWER_BYTES)
    if response.status != 308:
      return size, body
    held = response.headers.get("range", "")  # "bytes=0-N"; none: nothing held yet
    if not held or (self.emulated and held == "bytes=0-0"):  # the emulator's "nothing"
      return 0, None
    return int(held.rpartition("-")[2]) + 1, None


def _check_md5(answer: bytes, md5: bytes, where: str) -> None:
  reported = json.loads(answer).get("md5Hash")
  if reported and reported != base64.b64encode(md5).decode():
    raise UploadCorrupted(f"{where}: the store reports MD5 {_hex(reported)} for the object "
                          f"written, not {md5.hex()}, that of the bytes sent")


def _check_generation(response: http.Response, pin: FileInfo | None, where: str) -> None:
  """A store that served another generation than the one asked (an emulator ignores the
  parameter) is caught by the generation or checksums it names in its headers."""
  if pin is None:
    return
  served = response.headers.get("x-goog-generation")
  if served and pin.generation and served == pin.generation:
    return
  hashes = dict(part.strip().split("=", 1) for part in
                response.headers.get("x-goog-hash", "").split(",") if "=" in part)
  crc = _hex(hashes.get("crc32c"))
  md5 = _hex(hashes.get("md5"))
  if (crc and pin.crc32c and crc != pin.crc32c) or (md5 and pin.md5 and md5 != pin.md5):
    response.close()
    raise http.PreconditionFailed(f"{where}: the store served other bytes than the "
                                  f"generation {pin.generation} that was listed")


def _same_content(a: FileInfo, b: FileInfo) -> bool:
  if a.size != b.size:
    return False
  if a.md5 and b.md5:
    return a.md5 == b.md5 and (not (a.crc32c and b.crc32c) or a.crc32c == b.crc32c)
  return bool(a.crc32c and b.crc32c and a.crc32c == b.crc32c)


def _hex(value: str | None) -> str | None:
  if not value or value == "None":
    return None
  try:
    return base64.b64decode(value).hex()
  except ValueError:
    return None


def _info(bucket: str, item: dict) -> FileInfo:
  updated = item.get("updated")
  mtime = None
  if updated:
    when = datetime.datetime.fromisoformat(updated.replace("Z", "+00:00"))
    mtime = int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000
  generation = item.get("generation")
  return FileInfo(f"gs://{bucket}/{item['name']}", "file", int(item.get("size") or 0), mtime,
                  etag=item.get("etag") or None,
                  generation=str(generation) if generation else None,
                  md5=_hex(item.get("md5Hash")), crc32c=_hex(item.get("crc32c")))


def _fetch_token() -> tuple[str, float]:
  """(access token, its expiry as `time.time()`)."""
  if os.environ.get("GOOGLE_OAUTH_ACCESS_TOKEN"):
    return os.environ["GOOGLE_OAUTH_ACCESS_TOKEN"], time.time() + 3000
  try:
    import google.auth  # pylint: disable=import-outside-toplevel
    import google.auth.transport.requests  # pylint: disable=import-outside-toplevel
  except ImportError:
    google = None
  if google is not None:
    creds, _ = google.auth.default(
        scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    creds.refresh(google.auth.transport.requests.Request())
    expiry = creds.expiry.replace(tzinfo=datetime.timezone.utc) if creds.expiry else None
    return creds.token, expiry.timestamp() if expiry else time.time() + 3000
  answer = json.loads(http.request("GET", _METADATA_TOKEN, {"Metadata-Flavor": "Google"})
                      .read(1 << 16))
  return answer["access_token"], time.time() + int(answer.get("expires_in", 300))
