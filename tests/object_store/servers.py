"""Object-store servers on 127.0.0.1 for the tests and the bench, each in a child process.

- S3: moto's `ThreadedMotoServer` (the `test` extra), read by pyarrow's `S3FileSystem`.
  It closes each connection after one answer; `fault_proxy` in front keeps client
  connections open, as real S3 does.
- GCS: `gcp-storage-emulator` (the `test` extra), read by pyarrow's `GcsFileSystem`.
  It answers one connection at a time; here each connection gets a thread of its own,
  and the queue of connections is made longer (with its own 5, concurrent clients
  waited a second for a connection). It must run in a
  process of its own: with the emulator's thread in the reading process, pyarrow's GCS
  file reads stall for good (the reading call keeps the interpreter lock while it
  waits, so the emulator's thread never answers).
- `delay_ms` / `proxy_port`: a `latency_proxy` process in front of the server.
- `fault_proxy()`: a `fault_proxy` process in front of the server, told what to
  break and for how long (`FaultProxy`).

Every child prints its port, serves until its standard input closes (when the
parent stops it, or dies), then exits; `stop()` also kills a child that lingers.
The environment a client needs (endpoint, test credentials) comes from
`environment()`: the filesystem layer reads nothing else.
"""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import types
from typing import Any

from pyarrow import fs as pafs

_HERE = os.path.dirname(os.path.abspath(__file__))
_ACCESS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}


class _Child:
  """A child process that printed its port and serves until its input closes."""

  def __init__(self, args: list[str]):
    self._process = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
    line = self._process.stdout.readline()
    if not line.strip().isdigit():
      self.stop()
      raise RuntimeError(f"{' '.join(args)} did not start (said {line!r})")
    self.port, self.pid = int(line), self._process.pid

  def ask(self, command: dict[str, Any]) -> dict[str, Any]:
    """Sends one JSON command line; its JSON answer line."""
    self._process.stdin.write(json.dumps(command) + "\n")
    self._process.stdin.flush()
    answer = json.loads(self._process.stdout.readline())
    if not answer["ok"]:
      raise RuntimeError(answer["error"])
    return answer

  def stop(self) -> None:
    try:
      self._process.stdin.close()
    except OSError:
      pass
    try:
      self._process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()
    self._process.stdout.close()


class LocalObjectStore:
  """An S3 (`kind="s3"`) or GCS (`kind="gcs"`) server holding one bucket."""

  def __init__(self, kind: str, bucket: str = "bucket-one", delay_ms: float = 0):
    if kind not in ("s3", "gcs"):
      raise ValueError(f"kind must be 's3' or 'gcs', not {kind!r}")
    self.kind, self.bucket = kind, bucket
    self._server = _Child([os.path.join(_HERE, "servers.py"), kind, bucket])
    self._proxies: list[_Child] = []
    self.port = self.proxy_port(delay_ms) if delay_ms else self._server.port

  def proxy_port(self, delay_ms: float) -> int:
    """The port of a new latency proxy in front of the server (stopped with it)."""
    proxy = _Child([os.path.join(_HERE, "latency_proxy.py"), str(self._server.port),
                    str(delay_ms)])
    self._proxies.append(proxy)
    return proxy.port

  def fault_proxy(self, delay_ms: float = 0) -> FaultProxy:
    """A new fault-injecting proxy in front of the server (stopped with it), a keep-alive
    endpoint that holds back each request by `delay_ms`."""
    child = _Child([os.path.join(_HERE, "fault_proxy.py"), str(self._server.port),
                    str(delay_ms)])
    self._proxies.append(child)
    return FaultProxy(child)

  def environment(self, port: int | None = None) -> dict[str, str]:
    """The variables that point `bagel_grain.fs` at this server (through `port`)."""
    endpoint = f"http://127.0.0.1:{port or self.port}"
    if self.kind == "s3":
      return {**_ACCESS, "AWS_ENDPOINT_URL": endpoint}
    return {"STORAGE_EMULATOR_HOST": endpoint}

  def uri(self, *parts: str) -> str:
    return "/".join([f"{'s3' if self.kind == 's3' else 'gs'}://{self.bucket}", *parts])

  def filesystem(self) -> pafs.FileSystem:
    """A pyarrow client of the server itself (no proxy), for setting up data."""
    endpoint = f"127.0.0.1:{self._server.port}"
    if self.kind == "s3":
      return pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                               endpoint_override=endpoint, scheme="http")
    return pafs.GcsFileSystem(anonymous=True, endpoint_override=endpoint, scheme="http")

  def upload(self, local_dir: str, prefix: str) -> str:
    """Copies a local folder's files under `prefix`; returns the prefix's URI."""
    client = self.filesystem()
    for root, _, names in os.walk(local_dir):
      for name in names:
        path = os.path.join(root, name)
        relative = os.path.relpath(path, local_dir).replace(os.sep, "/")
        with open(path, "rb") as f, client.open_output_stream(
            f"{self.bucket}/{prefix}/{relative}") as out:
          out.write(f.read())
    return self.uri(prefix)

  def upload_file(self, local_path, key: str) -> None:
    """Copies one local file to `key` under the bucket."""
    with open(local_path, "rb") as f, self.filesystem().open_output_stream(
        f"{self.bucket}/{key}") as out:
      out.write(f.read())

  def delete(self, key: str) -> None:
    """Deletes one object (a key under the bucket), directly on the server."""
    self.filesystem().delete_file(f"{self.bucket}/{key}")

  def pids(self) -> list[int]:
    """The process ids of the server and its proxies (to measure the CPU they burn)."""
    return [child.pid for child in [self._server, *self._proxies]]

  def stop(self) -> None:
    for child in [*self._proxies, self._server]:
      child.stop()
    self._proxies = []

  def __enter__(self) -> LocalObjectStore:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


class FaultProxy:
  """Tells a `fault_proxy` process what to break: `fault("reset", seconds=10)`,
  `fault("503", count=3, match="images/a.jpg")`, `clear()`; `counts()` of connections,
  requests by method and faults injected."""

  def __init__(self, child: _Child):
    self._child, self.port = child, child.port

  def fault(self, kind: str, *, seconds: float | None = None, count: int | None = None,
            match: str = "") -> None:
    command = {"action": "fault", "kind": kind, "match": match}
    command.update({k: v for k, v in (("seconds", seconds), ("count", count)) if v is not None})
    self._child.ask(command)

  def clear(self) -> None:
    self._child.ask({"action": "clear"})

  def counts(self) -> dict[str, int]:
    return self._child.ask({"action": "counts"})["counts"]

  def captured(self) -> list[str]:
    """The request heads that the other host of a `redirect` fault received."""
    return self._child.ask({"action": "captured"})["counts"]["heads"]

  def targets(self) -> dict[str, int]:
    """Requests so far by "METHOD target" (the target URL-decoded)."""
    return self._child.ask({"action": "targets"})["counts"]


def _serve_s3(bucket: str) -> None:
  from moto.server import ThreadedMotoServer  # pylint: disable=import-outside-toplevel
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  server.start()
  port = server.get_host_and_port()[1]
  pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                    endpoint_override=f"127.0.0.1:{port}", scheme="http",
                    allow_bucket_creation=True).create_dir(bucket)
  print(port, flush=True)


def _serve_gcs(bucket: str) -> None:
  from gcp_storage_emulator.server import create_server  # pylint: disable=import-outside-toplevel
  server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
  server.start()
  httpd = server._api._httpd  # pylint: disable=protected-access  # no accessor for these
  # Its HTTPServer queues 5 connections: past that the kernel drops a client's SYN, and
  # the client waits a whole second to send it again. A real endpoint queues many.
  httpd.socket.listen(128)
  # One thread per connection, as a real endpoint serves many at once: answering one
  # connection at a time, a client that holds an answer unread (an abandoned read, a
  # request past its deadline) kept every other request waiting until its own deadline.
  httpd.daemon_threads, httpd.block_on_close = True, False
  httpd._threads = socketserver._NoThreads()  # pylint: disable=protected-access
  httpd.process_request_thread = types.MethodType(
      socketserver.ThreadingMixIn.process_request_thread, httpd)
  httpd.process_request = types.MethodType(socketserver.ThreadingMixIn.process_request, httpd)
  print(httpd.server_address[1], flush=True)


if __name__ == "__main__":
  {"s3": _serve_s3, "gcs": _serve_gcs}[sys.argv[1]](sys.argv[2])
  sys.stdin.read()  # until the parent closes our input (or dies)
  os._exit(0)  # pylint: disable=protected-access  # in-memory servers: nothing to flush, and
  # a graceful stop can wait forever on a client that keeps its connection open
