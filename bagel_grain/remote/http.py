"""Bounded HTTP/1.1 requests to an object store: every wait has a deadline, every body a bound.

The object-store clients (`remote.s3`, `remote.gcs`) send their requests here, so
that what a misbehaving store can cost is fixed by us, not by the store:

- a deadline (`deadline_scope`, else `ATTEMPT_S` from the request's start) holds
  inside a read, and inside the sending of a body (in blocks of 64 KiB, each
  within `IDLE_S`): a watchdog cuts the connection when it passes, so a body that
  trickles in at 3 bytes a second ends there, as `TimeoutError` (transient), and a
  request that receives nothing for `IDLE_S` ends sooner;
- a body is read to at most the caller's bound (`max_bytes`); a declared
  `Content-Length` over it is a definite answer before a byte is read
  (`BodyTooLarge`), and a connection whose body was not read to its end is closed,
  never reused: nothing of a refused answer stays in memory;
- a redirect is never followed (`RedirectRefused`, definite): the request's
  credentials (an S3 session token, a bearer token) would go along to a host we
  did not choose.

Status codes are sorted into Python's exceptions, which `storage.is_transient`
reads: 404 `FileNotFoundError`, 401/403 `PermissionError`, 412 `PreconditionFailed`
(the object is not the one pinned), 408/429/5xx `TransientHTTPError` (a
`ConnectionError`), any other `HTTPStatusError` (definite). Connections are kept
alive, a few per host; one that the server closed while idle is replaced once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import http.client
import io
import itertools
import re
import socket
import threading
import time
import urllib.parse
from typing import Iterator

from bagel_grain import interpreter_exit, io_limits

IDLE_S = 10.0  # a socket that receives nothing this long fails (transient)
CONNECT_S = 5.0
ATTEMPT_S = 120.0  # an attempt outside any deadline scope ends by this
ERROR_BODY_BYTES = 64 << 10  # read of an error answer, for its message
_CHUNK = 1 << 16


class TransientHTTPError(ConnectionError):
  """An answer that may change if asked again: throttling, a timeout, a 5xx."""


class DefiniteError(OSError):
  """A definite answer about the object: asking again gives the same (never retried)."""


class HTTPStatusError(DefiniteError):
  """A definite answer by status code that none of Python's exceptions names."""

  def __init__(self, message: str, status: int):
    super().__init__(message)
    self.status = status


class PreconditionFailed(DefiniteError):
  """412: the object is not the one the request was pinned to (If-Match, a generation)."""


class RedirectRefused(DefiniteError, PermissionError):
  """The store answered with a redirect, which is not followed (credentials would go along)."""


class BodyTooLarge(DefiniteError):
  """An answer larger than the caller's bound; `size` is what it declared, or None."""

  def __init__(self, message: str, size: int | None):
    super().__init__(message)
    self.size = size


class _Deadlines(threading.local):
  at: float | None = None


_DEADLINES = _Deadlines()


@contextlib.contextmanager
def deadline_scope(at: float | None) -> Iterator[None]:
  """Within it, every request of this thread ends by `at` (`time.monotonic()` seconds;
  None: no deadline of its own). Scopes nest: the sooner deadline holds."""
  outer = _DEADLINES.at
  if at is not None and outer is not None:
    at = min(at, outer)
  _DEADLINES.at = outer if at is None else at
  try:
    yield
  finally:
    _DEADLINES.at = outer


def current_deadline() -> float | None:
  return _DEADLINES.at


class _Watchdog:
  """One daemon thread that cuts the sockets whose deadline passed (a blocked `recv`
  returns at once), so no read waits past its deadline whatever the server sends."""

  def __init__(self):
    self._heap: list[tuple[float, int, socket.socket]] = []
    self._order = itertools.count()
    self._cond = threading.Condition()
    self._thread: threading.Thread | None = None

  def watch(self, sock: socket.socket, at: float) -> int:
    with self._cond:
      ticket = next(self._order)
      heapq.heappush(self._heap, (at, ticket, sock))
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name="bagel-grain-deadlines",
                                        daemon=True)
        self._thread.start()
      if self._heap[0][1] == ticket:  # the soonest now: the thread waits for it instead
        self._cond.notify()
      return ticket

  def release(self, ticket: int) -> None:
    with self._cond:
      self._heap = [entry for entry in self._heap if entry[1] != ticket]
      heapq.heapify(self._heap)

  def cut_all(self) -> None:
    """Cuts every socket being read now (the interpreter exits: see `interpreter_exit`)."""
    with self._cond:
      socks = [entry[2] for entry in self._heap]
    for sock in socks:
      with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)

  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._heap or self._heap[0][0] > time.monotonic():
          self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
        _, _, sock = heapq.heappop(self._heap)
      with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG = _Watchdog()
interpreter_exit.on_exit(_WATCHDOG.cut_all)


@dataclasses.dataclass
class Response:
  """An answer whose body is read on demand (`read`), within the request's deadline."""

  status: int
  headers: dict[str, str]  # names in lower case
  url: str
  _raw: http.client.HTTPResponse
  _conn: http.client.HTTPConnection
  _pool: _Pool
  _deadline: float
  _ticket: int

  def declared_size(self) -> int | None:
    value = self.headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None

  def read(self, max_bytes: int) -> bytes:
    """The whole body; `BodyTooLarge` (the connection closed) past `max_bytes`."""
    declared = self.declared_size()
    if declared is not None and declared > max_bytes:
      self.close()
      raise BodyTooLarge(f"{self.url}: {declared} bytes declared > {max_bytes}", declared)
    body = bytearray()
    try:
      while True:
        chunk = self._raw.read1(_CHUNK)  # one receive at most: the deadline is checked often
        if not chunk:
          break
        body += chunk
        if len(body) > max_bytes:
          raise BodyTooLarge(f"{self.url}: more than {max_bytes} bytes", None)
        self._check_time()
      if declared is not None and len(body) < declared:
        raise TransientHTTPError(f"{self.url}: the answer ended after {len(body)} of "
                                 f"{declared} bytes")
    except (OSError, http.client.HTTPException) as e:
      self.close()
      raise _cut(e, self.url, self._deadline) from None
    self._finish()
    return bytes(body)

  def done(self) -> None:
    """Ends an answer that has no body (HEAD): its connection is reused."""
    self._raw.read()
    self._finish()

  def _check_time(self) -> None:
    if time.monotonic() >= self._deadline:
      raise TimeoutError(f"{self.url}: the answer was not read within its deadline")

  def _finish(self) -> None:
    _WATCHDOG.release(self._ticket)
    if not self._raw.will_close and (self._raw.isclosed() or self._raw.length == 0):
      self._raw.close()  # its connection is free for the next request
      self._pool.give_back(self._conn)
    else:
      self.close()

  def close(self) -> None:
    """Drops the answer unread: the connection is closed, not reused."""
    _WATCHDOG.release(self._ticket)
    self._raw.close()  # holds the socket when the connection let go of it
    self._conn.close()


def _cut(error: BaseException, url: str, deadline: float) -> OSError:
  """The error for a connection that failed mid-answer: past the deadline a timeout, else
  a transient failure (a cut connection, an answer ended early)."""
  if isinstance(error, BodyTooLarge):
    return error
  if time.monotonic() >= deadline - 0.001:
    return TimeoutError(f"{url}: no complete answer within its deadline")
  if isinstance(error, (TransientHTTPError, TimeoutError, ConnectionError)):
    return error
  return TransientHTTPError(f"{url}: {type(error).__name__}: {error}")


class _Pool:
  """Idle keep-alive connections by (scheme, host:port)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}

  def take(self, scheme: str, netloc: str) -> http.client.HTTPConnection | None:
    with self._lock:
      idle = self._idle.get((scheme, netloc))
      return idle.pop() if idle else None

  def give_back(self, conn: http.client.HTTPConnection) -> None:
    key = ("https" if isinstance(conn, http.client.HTTPSConnection) else "http",
           f"{conn.host}:{conn.port}")
    with self._lock:
      idle = self._idle.setdefault(key, [])
      if len(idle) < io_limits.IDLE_PER_HOST:
        idle.append(conn)
        return
    conn.close()


_POOL = _Pool()


def request(method: str, url: str, headers: dict[str, str] | None = None,
            body: bytes = b"", accept: frozenset[int] = frozenset()) -> Response:
  """Sends one request (with `body`, sent within the same deadline); the answer with its
  body unread (`Response.read`).

  Raises for any status but 2xx and those in `accept` (GCS's 308 "resume incomplete"),
  after reading at most `ERROR_BODY_BYTES` of it for the message, and TimeoutError
  past the deadline."""
  parts = urllib.parse.urlsplit(url)
  target = parts.path + (f"?{parts.query}" if parts.query else "")
  now = time.monotonic()
  deadline = current_deadline()
  deadline = now + ATTEMPT_S if deadline is None else deadline
  if now >= deadline:
    raise TimeoutError(f"{url}: no time left for the request")
  for fresh in (False, True):
    interpreter_exit.check()
    conn = None if fresh else _POOL.take(parts.scheme, parts.netloc)
    reused = conn is not None
    if conn is None:
      conn = _connect(parts.scheme, parts.netloc, deadline)
    sock = conn.sock  # kept: the connection lets go of it when the answer closes it
    ticket = _WATCHDOG.watch(sock, deadline)
    try:
      sock.settimeout(max(0.001, min(IDLE_S, deadline - time.monotonic())))
      sent = dict(headers or {})
      if body:  # sent in blocks, each within `IDLE_S`, not as one send bounded by it
        sent["Content-Length"] = str(len(body))
      conn.request(method, target, body=io.BytesIO(body) if body else None, headers=sent)
      raw = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
      _WATCHDOG.release(ticket)
      conn.close()
      if reused and isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError,
                                   BrokenPipeError, http.client.ImproperConnectionState)):
        continue  # the server closed it while it was idle: once more on a new one
      raise _cut(e, url, deadline) from None
    break
  sock.settimeout(max(0.001, min(IDLE_S, deadline - time.monotonic())))
  response = Response(raw.status, {k.lower(): v for k, v in raw.getheaders()}, url, raw, conn,
                      _POOL, deadline, ticket)
  if 200 <= raw.status < 300 or raw.status in accept:
    return response
  _raise_for_status(response, method)
  raise AssertionError("unreachable")


def _connect(scheme: str, netloc: str, deadline: float) -> http.client.HTTPConnection:
  timeout = max(0.001, min(CONNECT_S, deadline - time.monotonic()))
  cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
  conn = cls(netloc, timeout=timeout, blocksize=_CHUNK)
  try:
    conn.connect()
  except OSError as e:
    conn.close()
    if isinstance(e, (ConnectionError, TimeoutError, socket.timeout)):
      raise
    raise TransientHTTPError(f"{scheme}://{netloc}: {e}") from None
  return conn


def _what(body: str) -> str:
  """What an error answer says, short: S3's `<Code>`, GCS's JSON message, or its start."""
  code = re.search(r"<Code>([^<]{1,100})</Code>", body)
  if code:
    return code.group(1)
  message = re.search(r'"message":\s*"([^"]{1,200})"', body)
  return message.group(1) if message else body[:200]


def _raise_for_status(response: Response, method: str) -> None:
  status, url = response.status, response.url
  if 300 <= status < 400:
    response.close()
    target = urllib.parse.urlsplit(response.headers.get("location", "")).netloc or "no host"
    raise RedirectRefused(f"{url}: the store redirects ({status}) to {target}; redirects are "
                          "not followed (the request's credentials would go along). Point the "
                          "endpoint at the bucket's own region or host")
  text = ""
  if method != "HEAD":
    try:
      text = response.read(ERROR_BODY_BYTES).decode("utf-8", "replace")
    except OSError:
      text = ""
  else:
    response.close()
  message = f"{url}: HTTP {status} {_what(text)}".strip()
  if status == 404:
    raise FileNotFoundError(message)
  if status in (401, 403):
    raise PermissionError(message)
  if status == 412:
    raise PreconditionFailed(message)
  if status in (408, 429) or status >= 500:
    raise TransientHTTPError(message)
  raise HTTPStatusError(message, status)
