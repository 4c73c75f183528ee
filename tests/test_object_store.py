"""Data in a bucket: the demo data on a local S3 server and a GCS emulator gives the local batches."""

import socket
import threading
import time

import numpy as np
import pytest

from bagel_grain import fs
from bagel_grain.config import config_from_dict
from object_store import LatencyProxy, LocalObjectStore
from bagel_grain.pipeline import build_pipeline
from bagel_grain.tokenizer import load_tokenizer
from conftest import CONFIGS
from shipped_demo import shipped_demo_raw

BATCHES = 4


@pytest.fixture(scope="module", params=["s3", "gcs"])
def bucket(request, demo_dir):
  """(server, URI of the demo data uploaded to it); the server stops with the module."""
  with LocalObjectStore(request.param) as store:
    yield store, store.upload(str(demo_dir), "demo")


def _remote_config(root: str, demo_dir):
  """The shipped demo.yaml with every path a URI under `root`."""
  return config_from_dict(shipped_demo_raw(demo_dir, root), file="remote.yaml",
                          base_dir=str(CONFIGS))


def _batches(cfg, tokenizer, workers: int) -> list[dict]:
  it = iter(build_pipeline(cfg, tokenizer, batch_size=2, workers=workers))
  try:
    return [next(it) for _ in range(BATCHES)]
  finally:
    it.close()


def _assert_same_batches(remote: list[dict], local: list[dict], root: str, demo_dir) -> None:
  for r, l in zip(remote, local, strict=True):
    assert r.keys() == l.keys()
    for key in r:
      if key == "sample_keys":  # the same records, named by their remote path
        named = [[k[:3] + (k[3].replace(root, str(demo_dir)),) for k in row] for row in r[key]]
        assert named == [[tuple(k) for k in row] for row in l[key]]
      else:
        assert r[key].dtype == l[key].dtype and np.array_equal(r[key], l[key]), key


# Workers only on S3: the GCS emulator serves one request at a time.
@pytest.mark.parametrize("bucket, workers", [("s3", 0), ("s3", 2), ("gcs", 0)],
                         indirect=["bucket"])
def test_remote_config_gives_the_local_batches_bit_for_bit(bucket, workers, demo_dir,
                                                           demo_config, demo_tokenizer,
                                                           monkeypatch):
  store, root = bucket
  for name, value in store.environment().items():
    monkeypatch.setenv(name, value)
  cfg = _remote_config(root, demo_dir)
  assert all(p.startswith(root) for g in cfg.groups for d in g.datasets
             for p in (d.data_dir, d.jsonl_path or root, d.parquet_info_path or root))
  tokenizer = load_tokenizer(cfg.tokenizer_path)
  assert tokenizer.fingerprint() == demo_tokenizer.fingerprint()
  _assert_same_batches(_batches(cfg, tokenizer, workers), _batches(demo_config, demo_tokenizer, 0),
                       root, demo_dir)


def test_listing_and_ranges_through_the_filesystem_layer(bucket, demo_dir, monkeypatch):
  store, root = bucket
  for name, value in store.environment().items():
    monkeypatch.setenv(name, value)
  local = sorted(p.name for p in (demo_dir / "t2i").glob("*.parquet"))
  assert [p.rsplit("/", 1)[1] for p in fs.list_files(f"{root}/t2i", ".parquet")] == local
  assert fs.is_dir(f"{root}/vlm") and not fs.exists(f"{root}/no-such-file")
  data = (demo_dir / "vlm" / "sft.jsonl").read_bytes()
  assert fs.read_bytes(f"{root}/vlm/sft.jsonl") == data
  with fs.open_random_access(f"{root}/vlm/sft.jsonl") as f:
    assert f.read_at(100, 1000) == data[1000:1100]


def _echo_server() -> tuple[socket.socket, threading.Thread]:
  """A server that answers each message with its bytes reversed."""
  listener = socket.create_server(("127.0.0.1", 0))

  def serve():
    while True:
      try:
        conn, _ = listener.accept()
      except OSError:
        return
      with conn:
        while data := conn.recv(1 << 20):
          conn.sendall(data[::-1])

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  return listener, thread


def _ask(sock: socket.socket, message: bytes) -> bytes:
  sock.sendall(message)
  answer = b""
  while len(answer) < len(message):
    answer += sock.recv(1 << 20)
  return answer


def test_latency_proxy_holds_back_each_request_and_passes_bytes_unchanged():
  listener, thread = _echo_server()
  delay = 0.05
  with LatencyProxy(listener.getsockname()[1], delay) as proxy:
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
      start = time.perf_counter()
      answers = [_ask(sock, f"request {i}".encode()) for i in range(3)]
      # A lower bound only: a busy machine can make it slower, never faster.
      assert time.perf_counter() - start >= 3 * delay
  listener.close()
  thread.join(timeout=5)
  assert answers == [f"request {i}".encode()[::-1] for i in range(3)]


def test_latency_proxy_stops_with_connections_open():
  listener, thread = _echo_server()
  proxy = LatencyProxy(listener.getsockname()[1], 0.0)
  sock = socket.create_connection(("127.0.0.1", proxy.port))
  assert _ask(sock, b"abc") == b"cba"
  proxy.close()
  assert sock.recv(10) == b""  # the proxy cut the connection
  sock.close()
  with pytest.raises(OSError):
    socket.create_connection(("127.0.0.1", proxy.port), timeout=1)
  listener.close()
  thread.join(timeout=5)
