"""S3 (and S3-compatible servers) over `remote.http`: list, head, get, put and delete, signed
with SigV4.

Credentials come from the environment as AWS's tools read them:
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, else the
`AWS_PROFILE` (or default) profile of `~/.aws/credentials`; with none, requests
go unsigned (public buckets). The region is `AWS_REGION` / `AWS_DEFAULT_REGION`
(default us-east-1); `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` points at another
server (path-style addressing).

A read pinned to what a listing saw sends `If-Match: <ETag>` (and `versionId`
where the store reports versions): the store answers 412 if the object is not
those bytes any more. An identical re-upload keeps its ETag (the MD5 of the
bytes, or of its parts for a multipart upload with the same part size).

An object is written whole (`upload`): up to `PART_BYTES` in one PUT, a larger one
as a multipart upload of parts of `PART_BYTES` read one at a time from its file
(one part in memory), aborted if it fails. Every request of a write is passed to the
caller's `retry` on its own: a PUT of a whole object or of a part is idempotent. A
body is signed with its SHA-256 and sent with its Content-MD5: the store checks both.
"""

from __future__ import annotations

import configparser
import dataclasses
import datetime
import functools
import hashlib
import hmac
import base64
import contextlib
import os
import time
import urllib.parse
import xml.etree.ElementTree as ET

from bagel_grain.remote import http
from bagel_grain.remote.objects import FileInfo, Page, collect_pages
from bagel_grain.remote.writes import Retry, UploadSource

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
LIST_PAGE_BYTES = 16 << 20  # one page of 1000 keys is well under 1 MB
# A multipart upload's parts (S3 takes 5 MiB to 5 GiB, 10,000 of them): 8 MiB, as the AWS
# CLI and boto3 send, so the object's ETag is the one `sources.identity` computes.
PART_BYTES = 8 << 20
_MAX_PARTS = 10_000
_ANSWER_BYTES = 1 << 20  # the answer to a write: a few hundred bytes of XML
_ABORT_S = 10.0  # an abort after a failure is tried once, this long at most
_HEX = set("0123456789abcdef")


@dataclasses.dataclass(frozen=True)
class Credentials:
  access_key: str
  secret_key: str
  token: str | None = None


def _credentials(env: dict[str, str | None]) -> Credentials | None:
  if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
    return Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                       env.get("AWS_SESSION_TOKEN") or None)
  path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
  parser = configparser.ConfigParser()
  if not os.path.isfile(path) or not parser.read(path):
    return None
  section = env.get("AWS_PROFILE") or "default"
  if not parser.has_section(section):
    return None
  profile = parser[section]
  if "aws_access_key_id" not in profile:
    return None
  return Credentials(profile["aws_access_key_id"], profile.get("aws_secret_access_key", ""),
                     profile.get("aws_session_token"))


class S3Client:
  """One endpoint, region and set of credentials (made once per process by `fs`)."""

  def __init__(self, env: dict[str, str | None]):
    self.region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    self.endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "")
    self.endpoint = self.endpoint.rstrip("/")
    if self.endpoint and "://" not in self.endpoint:
      self.endpoint = "http://" + self.endpoint
    self.credentials = _credentials(env)

  def _url(self, bucket: str, key: str, query: dict[str, str]) -> str:
    key = urllib.parse.quote(key, safe="/~")
    if self.endpoint:  # path style: http://host:port/bucket/key
      url = f"{self.endpoint}/{bucket}" + (f"/{key}" if key else "")
    elif "." not in bucket:
      url = f"https://{bucket}.s3.{self.region}.amazonaws.com/{key}"
    else:
      url = f"https://s3.{self.region}.amazonaws.com/{bucket}/{key}"
    encoded = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
    return url + (f"?{encoded}" if encoded else "")

  def _send(self, method: str, bucket: str, key: str, query: dict[str, str] | None = None,
            headers: dict[str, str] | None = None, body: bytes = b"") -> http.Response:
    url = self._url(bucket, key, query or {})
    headers = dict(headers or {})
    if body:
      headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()
    if self.credentials is not None:
      payload = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA256
      headers.update(_sign(method, url, headers, self.credentials, self.region,
                           payload=payload))
    return http.request(method, url, headers, body)

  def list(self, bucket: str, prefix: str, max_entries: int) -> list[FileInfo]:
    """The objects directly under `prefix` (a folder, ending in "/")."""
    def page(token: str | None) -> Page:
      query = {"list-type": "2", "prefix": prefix, "delimiter": "/"}
      if token:
        query["continuation-token"] = token
      root = ET.fromstring(self._send("GET", bucket, "", query).read(LIST_PAGE_BYTES))
      files = [_listed(bucket, item) for item in root.iter(_NS + "Contents")]
      files = [f for f in files if not f.path.endswith("/")]
      truncated = (root.findtext(_NS + "IsTruncated") or "").lower() == "true"
      return files, (root.findtext(_NS + "NextContinuationToken") if truncated else None)
    return collect_pages(page, f"s3://{bucket}/{prefix}", max_entries)

  def has_children(self, bucket: str, prefix: str) -> bool:
    query = {"list-type": "2", "prefix": prefix, "max-keys": "1"}
    root = ET.fromstring(self._send("GET", bucket, "", query).read(LIST_PAGE_BYTES))
    return root.find(_NS + "Contents") is not None or root.find(_NS + "CommonPrefixes") is not None

  def head(self, bucket: str, key: str) -> FileInfo:
    response = self._send("HEAD", bucket, key)
    response.done()
    return _info(f"s3://{bucket}/{key}", response.headers)

  def get(self, bucket: str, key: str, *, max_bytes: int, first: int = 0,
          last: int | None = None, pin: FileInfo | None = None) -> bytes:
    """Bytes `first`..`last` (inclusive; None: to the end) of at most `max_bytes`; a pinned
    read raises `http.PreconditionFailed` when the object's ETag is not the pin's."""
    headers, query = {}, {}
    if first or last is not None:
      headers["Range"] = f"bytes={first}-{'' if last is None else last}"
    if pin is not None and pin.etag:
      headers["If-Match"] = f'"{pin.etag}"'
    if pin is not None and pin.generation:
      query["versionId"] = pin.generation
    return self._send("GET", bucket, key, query, headers).read(max_bytes)


  def delete(self, bucket: str, key: str) -> None:
    """Deletes an object (one already gone is no error: S3 answers 204 either way)."""
    self._send("DELETE", bucket, key).read(_ANSWER_BYTES)

  def upload(self, bucket: str, key: str, source: UploadSource, retry: Retry) -> None:
    """Writes `source` (`size` bytes) as the object; it appears only once whole."""
    if source.size <= PART_BYTES:
      data = source.read(0, source.size)
      retry(lambda: self._send("PUT", bucket, key, body=data).read(_ANSWER_BYTES))
      return
    part = max(PART_BYTES, -(-source.size // _MAX_PARTS))
    upload_id = retry(lambda: self._create_upload(bucket, key))
    try:
      etags, digests = [], []
      for number, offset in enumerate(range(0, source.size, part), start=1):
        data = source.read(offset, min(part, source.size - offset))
        digests.append(hashlib.md5(data).digest())
        query = {"partNumber": str(number), "uploadId": upload_id}
        etags.append(retry(lambda: self._send("PUT", bucket, key, query, body=data)  # pylint: disable=cell-var-from-loop
                           ).headers.get("etag", ""))
        del data
      whole = f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"
      retry(lambda: self._complete_upload(bucket, key, upload_id, etags, whole))
    except BaseException:
      with contextlib.suppress(Exception), http.deadline_scope(time.monotonic() + _ABORT_S):
        self._send("DELETE", bucket, key, {"uploadId": upload_id}).read(_ANSWER_BYTES)
      raise

  def _create_upload(self, bucket: str, key: str) -> str:
    root = ET.fromstring(self._send("POST", bucket, key, {"uploads": ""}).read(_ANSWER_BYTES))
    upload_id = root.findtext(_NS + "UploadId")
    if not upload_id:
      raise http.HTTPStatusError(f"s3://{bucket}/{key}: no UploadId in the answer to "
                                 "CreateMultipartUpload", 200)
    return upload_id

  def _complete_upload(self, bucket: str, key: str, upload_id: str, etags: list[str],
                       whole: str) -> None:
    """Completes the upload; `whole` is the ETag the object gets (the MD5 of the parts'
    MD5s, and their count), which tells a retry whose first try did complete it."""
    parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>"
                    for n, e in enumerate(etags, start=1))
    body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
    try:
      answer = self._send("POST", bucket, key, {"uploadId": upload_id}, body=body)
    except FileNotFoundError:  # NoSuchUpload: completed by an earlier try whose answer was lost?
      if self.head(bucket, key).etag == whole:
        return
      raise
    root = ET.fromstring(answer.read(_ANSWER_BYTES))
    if root.tag.endswith("Error"):  # S3 may answer 200 and report the failure in the body
      raise http.TransientHTTPError(f"s3://{bucket}/{key}: CompleteMultipartUpload answered "
                                    f"{root.findtext('Code') or 'an error'}")


def _listed(bucket: str, item: ET.Element) -> FileInfo:
  etag = (item.findtext(_NS + "ETag") or "").strip('"') or None
  size = int(item.findtext(_NS + "Size") or 0)
  return FileInfo(f"s3://{bucket}/{item.findtext(_NS + 'Key')}", "file", size,
                  _time_ns(item.findtext(_NS + "LastModified")), etag=etag,
                  md5=etag if etag and len(etag) == 32 and set(etag) <= _HEX else None)


def _info(path: str, headers: dict[str, str]) -> FileInfo:
  etag = headers.get("etag", "").strip('"') or None
  modified = headers.get("last-modified")
  mtime = None
  if modified:
    from email.utils import parsedate_to_datetime  # pylint: disable=import-outside-toplevel
    mtime = int(parsedate_to_datetime(modified).timestamp() * 1e9)
  return FileInfo(path, "file", int(headers.get("content-length", 0)), mtime, etag=etag,
                  generation=headers.get("x-amz-version-id"),
                  md5=etag if etag and len(etag) == 32 and set(etag) <= _HEX else None)


def _time_ns(text: str | None) -> int | None:
  if not text:
    return None
  when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
  return int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000


def _quote(text: str) -> str:
  return urllib.parse.quote(text, safe="-_.~")


@functools.lru_cache(maxsize=8)
def _signing_key(secret_key: str, day: str, region: str) -> bytes:
  """SigV4's key of a day and region: four HMACs, the same for every request that day."""
  key = ("AWS4" + secret_key).encode()
  for part in (day, region, "s3", "aws4_request"):
    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
  return key


def _sign(method: str, url: str, headers: dict[str, str], creds: Credentials,
          region: str, now: datetime.datetime | None = None,
          payload: str = _EMPTY_SHA256) -> dict[str, str]:
  """The headers that sign a request with AWS Signature Version 4; `payload` is the hex
  SHA-256 of the body (the store checks the body against it)."""
  parts = urllib.parse.urlsplit(url)
  now = now or datetime.datetime.now(datetime.timezone.utc)
  amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
  signed = {"host": parts.netloc, "x-amz-content-sha256": payload,
            "x-amz-date": amz_date}
  if creds.token:
    signed["x-amz-security-token"] = creds.token
  signed.update({k.lower(): v.strip() for k, v in headers.items()})
  names = sorted(signed)
  query = "&".join(sorted(parts.query.split("&"))) if parts.query else ""
  canonical = "\n".join([method, parts.path or "/", query,
                         "".join(f"{n}:{signed[n]}\n" for n in names), ";".join(names),
                         payload])
  scope = f"{day}/{region}/s3/aws4_request"
  to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                       hashlib.sha256(canonical.encode()).hexdigest()])
  signature = hmac.new(_signing_key(creds.secret_key, day, region), to_sign.encode(),
                       hashlib.sha256).hexdigest()
  out = {k: v for k, v in signed.items() if k.startswith("x-amz-")}
  out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                          f"SignedHeaders={';'.join(names)}, Signature={signature}")
  return out
