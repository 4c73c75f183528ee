"""A TCP proxy that holds back each request by a fixed delay: object-store latency on demand.

Between a client and a server on 127.0.0.1 (tests, `tools/storage_bench.py`): every
time the client starts sending after the server has answered (a new HTTP
request on a kept-alive connection, or the first bytes of a new connection),
the proxy waits `delay_s` before passing the bytes on. Connections are served
by their own threads, so concurrent requests wait concurrently, as they would
on a real network; only latency is added, never a bandwidth limit.

`python latency_proxy.py PORT DELAY_MS` runs one in its own process
(see `servers.py`): it prints the port it listens on and stops when its
standard input closes.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

_CHUNK = 1 << 16


class LatencyProxy:
  """Listens on 127.0.0.1 (`port`) and forwards to 127.0.0.1:`target_port`."""

  def __init__(self, target_port: int, delay_s: float):
    self.delay_s = delay_s
    self._target = ("127.0.0.1", target_port)
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.port = self._listener.getsockname()[1]
    self._closed = threading.Event()
    self._sockets: set[socket.socket] = set()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._accept, name="latency-proxy", daemon=True)
    self._thread.start()

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        client, _ = self._listener.accept()
      except OSError:
        return
      try:
        server = socket.create_connection(self._target)
      except OSError:
        client.close()
        continue
      for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      with self._lock:
        self._sockets.update((client, server))
      answered = threading.Event()
      answered.set()  # a new connection's first bytes are a new request
      threading.Thread(target=self._pump, args=(client, server, answered, True),
                       daemon=True).start()
      threading.Thread(target=self._pump, args=(server, client, answered, False),
                       daemon=True).start()

  def _pump(self, src: socket.socket, dst: socket.socket, answered: threading.Event,
            from_client: bool) -> None:
    try:
      while True:
        data = src.recv(_CHUNK)
        if not data:
          break
        if from_client:
          if answered.is_set():  # the client starts a new request
            answered.clear()
            time.sleep(self.delay_s)
        else:
          answered.set()
        dst.sendall(data)
    except OSError:
      pass
    finally:
      for s in (src, dst):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
        s.close()
      with self._lock:
        self._sockets.difference_update((src, dst))

  def close(self) -> None:
    """Stops listening and cuts every open connection."""
    self._closed.set()
    with self._lock:
      sockets = [self._listener, *self._sockets]  # a shutdown wakes a blocked accept()
    for s in sockets:
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    self._thread.join(timeout=2)
    self._listener.close()

  def __enter__(self) -> LatencyProxy:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def main(argv: list[str]) -> None:
  target_port, delay_ms = int(argv[0]), float(argv[1])
  proxy = LatencyProxy(target_port, delay_ms / 1000)
  print(proxy.port, flush=True)
  sys.stdin.read()  # until the parent closes our input (or dies)
  proxy.close()


if __name__ == "__main__":
  main(sys.argv[1:])
