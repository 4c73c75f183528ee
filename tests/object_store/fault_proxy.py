"""An HTTP proxy that breaks an object store on command: outages the tests can aim and time.

Between a client (pyarrow's S3 or GCS client) and a server on 127.0.0.1, it
passes each HTTP/1.x request and its answer through unchanged, unless a fault
is active for that request:

- `refuse`: the proxy stops listening (new connections are refused) and cuts the
  open ones, as a server that was killed;
- `reset`: the answer's head and half its body go out, then the connection is
  reset (a connection cut mid-response);
- `stall`: the request is held unanswered until the fault ends, then the
  connection is cut (a server that stops answering);
- `503`: answered `503 Slow Down` (S3's `SlowDown` throttling code in the body),
  connection kept;
- `slow`: the answer's body trickles out at 3 bytes a second;
- `short`: the answer claims 1000 bytes more than its body, sends the body, then
  stays silent (the connection held open);
- `huge`: answered at once with a claim of 10^12 bytes and an endless body of
  zeros, the server not asked; `endless` the same with no length at all;
- `redirect`: answered `307` to the same target on another host (127.0.0.2, the
  proxy's `capture` listener, which records every request it receives);
- `loop_list`: a listing page whose continuation token is always the same;
- `many_keys`: a listing of 1,000,000 keys in pages of 1000 (S3 XML or GCS JSON),
  made up by the proxy.

Otherwise it behaves as an endpoint that keeps connections alive, whatever the
server behind it does (moto's and the emulator's servers close each connection
after one answer): an answer whose length is known goes back on the client's
connection, which stays open, and the next request goes to the server on a new
one. So the counts of connections the tests read are the client's doing. A
fixed `delay_s` before each request adds latency, as `latency_proxy` does.

A fault lasts `seconds` (a time window from now) or `count` (the first N
requests it applies to), and applies to every request or to those whose
URL-decoded target contains `match` (an object's name). The proxy counts
connections, requests by method, and requests by method and target, so the
tests can check how the client talks to storage.

`python fault_proxy.py PORT [DELAY_MS]` runs one in its own process: it prints the port
it listens on, then reads one JSON command a line from its standard input and
answers each with one JSON line (`FaultProxy` in `servers.py` speaks it); it
stops when its input closes. A process of its own, because pyarrow's GCS reads
hold the interpreter lock while they wait: a proxy thread in the reading
process would never answer.
"""

from __future__ import annotations

import collections
import json
import socket
import struct
import sys
import threading
import time
import urllib.parse
from typing import Any

_CHUNK = 1 << 16
_SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
              b"<Message>Please reduce your request rate.</Message></Error>")


class Fault:
  """One fault: its kind, which requests it applies to, and when it ends."""

  def __init__(self, kind: str, *, seconds: float | None = None, count: int | None = None,
               match: str = ""):
    if kind not in ("refuse", "reset", "stall", "503", "slow", "short", "huge", "endless",
                    "redirect", "loop_list", "many_keys"):
      raise ValueError(f"unknown fault {kind!r}")
    self.kind, self.match = kind, match
    self.until = None if seconds is None else time.monotonic() + seconds
    self.left = count

  def active(self) -> bool:
    return ((self.until is None or time.monotonic() < self.until)
            and (self.left is None or self.left > 0))

  def applies(self, target: str) -> bool:
    """True (and one use spent) when this fault hits a request for `target`."""
    if not self.active() or self.match not in target:
      return False
    if self.left is not None:
      self.left -= 1
    return True


class FaultProxy:
  """Listens on 127.0.0.1 (`port`, kept across `refuse` faults) and forwards to `target_port`."""

  def __init__(self, target_port: int, delay_s: float = 0.0):
    self._target, self._delay_s = ("127.0.0.1", target_port), delay_s
    self._lock = threading.Lock()
    self._faults: list[Fault] = []
    self._open: set[socket.socket] = set()
    self.counts: collections.Counter[str] = collections.Counter()
    self.targets: collections.Counter[str] = collections.Counter()  # "GET <decoded target>"
    self._closed = threading.Event()
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.port = self._listener.getsockname()[1]
    self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
    self._thread.start()
    self.captured: list[str] = []  # request heads the `redirect` target received
    self._capture = _capture_listener()
    threading.Thread(target=self._run_capture, name="capture", daemon=True).start()

  def _run_capture(self) -> None:
    """The other host of a `redirect`: records each request head, answers 200."""
    while not self._closed.is_set():
      try:
        conn, _ = self._capture.accept()
      except OSError:
        return
      with conn:
        request = _read_message(conn.makefile("rb"), request=True)
        if request is not None:
          with self._lock:
            self.captured.append(request[0].decode("latin-1"))
          conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

  # -- commands ---------------------------------------------------------------

  def add(self, fault: Fault) -> None:
    with self._lock:
      self._faults.append(fault)
    if fault.kind == "refuse":
      self._cut_all()

  def clear(self) -> None:
    with self._lock:
      self._faults.clear()

  def _refusing(self) -> float:
    """Seconds left of an active `refuse` fault (0 when none)."""
    with self._lock:
      ends = [f.until or float("inf") for f in self._faults if f.kind == "refuse" and f.active()]
    return max(ends, default=time.monotonic()) - time.monotonic()

  def _fault_for(self, target: str) -> str | None:
    with self._lock:
      for fault in self._faults:
        if fault.kind != "refuse" and fault.applies(target):
          self.counts[f"fault_{fault.kind}"] += 1
          return fault.kind
    return None

  # -- connections ------------------------------------------------------------

  def _accept(self) -> None:
    while not self._closed.is_set():
      if self._refusing() > 0:
        self._listener.close()  # refused while the fault lasts: nothing listens on the port
        while self._refusing() > 0 and not self._closed.is_set():
          time.sleep(0.05)
        if self._closed.is_set():
          return
        self._listener = socket.create_server(("127.0.0.1", self.port))
      self._listener.settimeout(0.1)
      try:
        client, _ = self._listener.accept()
      except TimeoutError:
        continue
      except OSError:
        if self._closed.is_set():
          return
        continue
      client.settimeout(None)
      client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      with self._lock:
        self.counts["connections"] += 1
        self._open.add(client)
      threading.Thread(target=self._serve, args=(client,), daemon=True).start()

  def _serve(self, client: socket.socket) -> None:
    upstream: socket.socket | None = None
    reader = client.makefile("rb")
    try:
      while True:
        request = _read_message(reader, request=True)
        if request is None:
          return
        head, body, method, target = request
        if self._refusing() > 0:  # accepted just before the listener closed
          _reset(client)
          return
        with self._lock:
          self.counts[f"requests_{method}"] += 1
          self.targets[f"{method} {urllib.parse.unquote(target)}"] += 1
        fault = self._fault_for(urllib.parse.unquote(target))
        if fault == "stall":
          while self._fault_active("stall", target) and not self._closed.is_set():
            time.sleep(0.05)
          _reset(client)
          return
        if fault == "503":
          client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN), _SLOW_DOWN))
          continue
        if fault in ("huge", "endless"):
          self._send_endless(client, method, fault)
          return
        if fault == "redirect":
          host, port = self._capture.getsockname()[:2]
          location = f"http://{host}:{port}{target}".encode()
          client.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\n"
                         b"Content-Length: 0\r\n\r\n" % location)
          continue
        if fault == "many_keys":
          page = _made_up_listing(target)
          client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page))
          continue
        if self._delay_s:
          time.sleep(self._delay_s)
        if upstream is None:
          upstream = socket.create_connection(self._target)
          upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
          upstream_reader = upstream.makefile("rb")
        if fault == "loop_list":  # the server is asked for the first page again
          head = head.replace(b"continuation-token=again&", b"").replace(b"&pageToken=again", b"")
        upstream.sendall(head + body)
        answer = _read_message(upstream_reader, request=False, method=method)
        if answer is None:
          return
        answer_head, answer_body, keep_alive, _ = answer
        if fault == "loop_list":
          answer_body = _looping(answer_body)
          answer_head = _with_length(answer_head, len(answer_body))
        answer_head = _kept_alive(answer_head, len(answer_body))
        if fault == "slow":
          client.sendall(answer_head)
          for i in range(0, len(answer_body), 3):
            if self._closed.is_set():
              return
            client.sendall(answer_body[i:i + 3])
            time.sleep(1.0)
          continue
        if fault == "short":
          client.sendall(_with_length(answer_head, len(answer_body) + 1000) + answer_body)
          while not self._closed.is_set() and self._fault_active("short", target):
            time.sleep(0.05)
          _reset(client)
          return
        if fault == "reset":
          client.sendall(answer_head + answer_body[:len(answer_body) // 2])
          _reset(client)
          return
        client.sendall(answer_head + answer_body)
        if not keep_alive:  # the server closes after each answer: open anew next time
          upstream_reader.close()
          upstream.close()
          upstream = None
    except OSError:
      pass
    finally:
      if upstream is not None:
        upstream.close()
      reader.close()
      client.close()
      with self._lock:
        self._open.discard(client)

  def _send_endless(self, client: socket.socket, method: str, fault: str) -> None:
    """A 200 claiming 10^12 bytes (`huge`) or no length (`endless`), zeros until cut."""
    length = b"Content-Length: 1000000000000\r\n" if fault == "huge" else b"Connection: close\r\n"
    client.sendall(b"HTTP/1.1 200 OK\r\n" + length + b"\r\n")
    zeros = bytes(_CHUNK)
    while method != "HEAD" and not self._closed.is_set():
      client.sendall(zeros)  # raises once the client has gone
      with self._lock:
        self.counts["endless_bytes"] += len(zeros)

  def _fault_active(self, kind: str, target: str) -> bool:
    with self._lock:
      return any(f.kind == kind and f.active() and f.match in urllib.parse.unquote(target)
                 for f in self._faults)

  def _cut_all(self) -> None:
    with self._lock:
      sockets = list(self._open)
    for s in sockets:
      _reset(s)

  def close(self) -> None:
    self._closed.set()
    self._capture.close()
    self._cut_all()
    self._thread.join(timeout=2)
    self._listener.close()


def _kept_alive(head: bytes, body_length: int) -> bytes:
  """An answer's head as a keep-alive HTTP/1.1 endpoint sends it: no `Connection: close`,
  and a length for a body that the server delimited by closing."""
  lines = head.split(b"\r\n")
  status = b"HTTP/1.1 " + lines[0].split(b" ", 1)[1]
  kept = [line for line in lines[1:] if line and not line.lower().startswith(b"connection:")]
  if not any(line.lower().startswith((b"content-length:", b"transfer-encoding:"))
             for line in kept):
    kept.append(b"Content-Length: %d" % body_length)
  return b"\r\n".join([status, *kept]) + b"\r\n\r\n"


def _with_length(head: bytes, length: int) -> bytes:
  lines = [line for line in head.split(b"\r\n") if line
           and not line.lower().startswith((b"content-length:", b"transfer-encoding:"))]
  return b"\r\n".join([*lines, b"Content-Length: %d" % length]) + b"\r\n\r\n"


def _looping(body: bytes) -> bytes:
  """A listing page that says more follows, always with the same token."""
  if body.lstrip().startswith(b"{"):  # GCS JSON
    page = json.loads(body)
    page["nextPageToken"] = "again"
    return json.dumps(page).encode()
  body = body.replace(b"<IsTruncated>false</IsTruncated>", b"<IsTruncated>true</IsTruncated>")
  return body.replace(b"</ListBucketResult>",
                      b"<NextContinuationToken>again</NextContinuationToken></ListBucketResult>")


MANY_KEYS, KEYS_PER_PAGE = 1_000_000, 1000


def _made_up_listing(target: str) -> bytes:
  """One page of a listing of MANY_KEYS keys under the request's prefix."""
  query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)
  prefix = query.get("prefix", [""])[0]
  token = query.get("continuation-token", query.get("pageToken", ["0"]))[0]
  first = int(token)
  last = min(MANY_KEYS, first + KEYS_PER_PAGE)
  names = [f"{prefix}frame_{i:07d}.jpg" for i in range(first, last)]
  more = str(last) if last < MANY_KEYS else None
  if "list-type" in query:  # S3
    items = "".join(f"<Contents><Key>{n}</Key><Size>100</Size><ETag>\"e\"</ETag>"
                    "<LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>"
                    for n in names)
    tail = (f"<IsTruncated>true</IsTruncated><NextContinuationToken>{more}"
            "</NextContinuationToken>" if more else "<IsTruncated>false</IsTruncated>")
    return ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult xmlns=\"http://s3."
            f"amazonaws.com/doc/2006-03-01/\">{items}{tail}</ListBucketResult>").encode()
  page = {"items": [{"name": n, "size": "100", "generation": "1"} for n in names]}
  if more:
    page["nextPageToken"] = more
  return json.dumps(page).encode()


def _capture_listener() -> socket.socket:
  """A listener on another host than the proxy's: 127.0.0.2 (Linux routes 127/8 to the
  loopback), else `localhost` by name."""
  try:
    return socket.create_server(("127.0.0.2", 0))
  except OSError:
    return socket.create_server(("localhost", 0))


def _reset(sock: socket.socket) -> None:
  """Closes with a TCP reset (SO_LINGER 0), as a crashed peer does."""
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  sock.close()


def _read_message(reader, *, request: bool, method: str = "GET"):
  """One HTTP/1.x message off `reader`: (head, body, method or keep-alive, target), or None
  at end-of-file. The body is read by Content-Length, chunks, or to the end."""
  start = reader.readline()
  if not start:
    return None
  lines = [start]
  while True:
    line = reader.readline()
    if not line:
      return None
    lines.append(line)
    if line in (b"\r\n", b"\n"):
      break
  headers = {}
  for line in lines[1:-1]:
    name, _, value = line.decode("latin-1").partition(":")
    headers[name.strip().lower()] = value.strip()
  head = b"".join(lines)
  first = start.decode("latin-1").split()
  chunked = "chunked" in headers.get("transfer-encoding", "").lower()
  if request:
    body = _read_body(reader, headers, chunked, to_end=False)
    return head, body, first[0], first[1]
  status = int(first[1])
  version = first[0]
  connection = headers.get("connection", "").lower()
  keep_alive = (connection == "keep-alive" if version == "HTTP/1.0" else connection != "close")
  if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
    return head, b"", keep_alive, status
  if "content-length" not in headers and not chunked:
    return head, reader.read(), False, status  # to the end: the server closes
  return head, _read_body(reader, headers, chunked, to_end=False), keep_alive, status


def _read_body(reader, headers: dict, chunked: bool, *, to_end: bool) -> bytes:
  if chunked:
    out = []
    while True:
      size_line = reader.readline()
      out.append(size_line)
      size = int(size_line.split(b";")[0], 16)
      if size == 0:
        while (trailer := reader.readline()) not in (b"\r\n", b"\n", b""):
          out.append(trailer)
        out.append(b"\r\n")
        return b"".join(out)
      out.append(reader.read(size + 2))
  length = int(headers.get("content-length", 0) or 0)
  return reader.read(length) if length else b""


def _command(proxy: FaultProxy, line: str) -> dict[str, Any]:
  command = json.loads(line)
  action = command.pop("action")
  if action == "fault":
    proxy.add(Fault(command.pop("kind"), **command))
  elif action == "clear":
    proxy.clear()
  elif action == "targets":
    with proxy._lock:  # pylint: disable=protected-access
      return dict(proxy.targets)
  elif action == "captured":
    with proxy._lock:  # pylint: disable=protected-access
      return {"heads": list(proxy.captured)}
  elif action != "counts":
    raise ValueError(f"unknown action {action!r}")
  with proxy._lock:  # pylint: disable=protected-access
    return dict(proxy.counts)


def main(argv: list[str]) -> None:
  proxy = FaultProxy(int(argv[0]), float(argv[1]) / 1000 if len(argv) > 1 else 0.0)
  print(proxy.port, flush=True)
  for line in sys.stdin:
    try:
      answer = {"ok": True, "counts": _command(proxy, line)}
    except Exception as e:  # pylint: disable=broad-except  # told to the parent, which raises
      answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer), flush=True)
  proxy.close()


if __name__ == "__main__":
  main(sys.argv[1:])
