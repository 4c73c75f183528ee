"""Writes to a bucket through our own client: whole objects, in parts, through faults."""

import os

import pytest

from bagel_grain import fs
from bagel_grain.errors import StorageWriteError
from bagel_grain.remote import gcs, http, s3
from object_store import LocalObjectStore

S3_PART = 5 << 20  # the smallest part S3 (and moto) takes
GCS_PART = 256 << 10  # a resumable upload's chunks are multiples of 256 KiB


@pytest.fixture(scope="module", params=["s3", "gcs"])
def store(request):
  with LocalObjectStore(request.param) as server:
    yield server


@pytest.fixture
def small_parts(monkeypatch):
  monkeypatch.setattr(s3, "PART_BYTES", S3_PART)
  monkeypatch.setattr(gcs, "PART_BYTES", GCS_PART)


def _through(proxy, store, monkeypatch) -> None:
  for name, value in store.environment(proxy.port).items():
    monkeypatch.setenv(name, value)


def _large(store) -> bytes:
  """An object of 2.5 parts (random bytes: a part out of place shows)."""
  part = S3_PART if store.kind == "s3" else GCS_PART
  return os.urandom(2 * part + part // 2)


def _stored(store, key: str) -> bytes:
  """The object as the server holds it, read by another client (pyarrow's)."""
  with store.filesystem().open_input_stream(f"{store.bucket}/{key}") as f:
    return f.read()


def _part_requests(store, proxy) -> int:
  word = "partNumber=" if store.kind == "s3" else "upload_id="
  return sum(n for target, n in proxy.targets().items()
             if target.startswith("PUT ") and word in target)


def test_a_large_object_is_written_in_parts_and_reads_back_bit_for_bit(store, small_parts,
                                                                       tmp_path, monkeypatch):
  proxy = store.fault_proxy()
  _through(proxy, store, monkeypatch)
  data = _large(store)
  local = tmp_path / "shard.bin"
  local.write_bytes(data)
  fs.upload_file(str(local), store.uri("large", "shard.bin"))
  assert _part_requests(store, proxy) == 3  # in parts, not one request
  assert _stored(store, "large/shard.bin") == data
  assert fs.read_bytes(store.uri("large", "shard.bin")) == data
  back = tmp_path / "back.bin"
  fs.download_file(store.uri("large", "shard.bin"), str(back))
  assert back.read_bytes() == data


@pytest.mark.parametrize("fault", ["503", "reset"])
@pytest.mark.parametrize("where", ["part", "whole"])
def test_a_fault_on_a_write_is_retried_and_the_object_is_whole(store, small_parts, fault, where,
                                                               monkeypatch):
  # `reset` answers after the server took the request: the part (or the object) is there
  # and the client does not know it; `503` never reaches the server.
  proxy = store.fault_proxy()
  _through(proxy, store, monkeypatch)
  key = f"faults/{fault}-{where}.bin"
  if where == "part":
    data = _large(store)
    match = "partNumber=2" if store.kind == "s3" else "upload_id="
  else:
    data = os.urandom(1000)
    match = key
  proxy.fault(fault, count=1, match=match)
  fs.write_bytes(store.uri(key), data)
  assert proxy.counts()[f"fault_{fault}"] == 1
  assert _stored(store, key) == data


def test_a_multipart_upload_completed_but_unanswered_is_not_sent_again(small_parts,
                                                                       monkeypatch):
  with LocalObjectStore("s3") as store:
    proxy = store.fault_proxy()
    _through(proxy, store, monkeypatch)
    data = _large(store)
    proxy.fault("reset", count=1, match="completed.bin?uploadId=")  # the completion only
    fs.write_bytes(store.uri("completed.bin"), data)
    assert proxy.counts()["fault_reset"] == 1
    assert _stored(store, "completed.bin") == data


def test_a_write_to_an_endpoint_down_past_the_deadline_names_the_object(store, monkeypatch):
  proxy = store.fault_proxy()
  _through(proxy, store, monkeypatch)
  monkeypatch.setattr(fs, "WRITE_TIMEOUT_S", 1.0)
  proxy.fault("refuse", seconds=60)
  with pytest.raises(StorageWriteError, match=f"writing {store.uri('down.json')}:"):
    fs.write_bytes(store.uri("down.json"), b"{}")
  for name, value in store.environment().items():  # the server itself, not the proxy
    monkeypatch.setenv(name, value)
  assert not fs.exists(store.uri("down.json"))


def test_a_multipart_upload_that_fails_is_aborted_and_leaves_no_object(small_parts,
                                                                       monkeypatch):
  with LocalObjectStore("s3") as store:
    proxy = store.fault_proxy()
    _through(proxy, store, monkeypatch)
    monkeypatch.setattr(fs, "WRITE_TIMEOUT_S", 1.0)
    proxy.fault("503", seconds=60, match="partNumber=2")
    with pytest.raises(StorageWriteError, match="writing s3://bucket-one/aborted.bin:"):
      fs.write_bytes(store.uri("aborted.bin"), _large(store))
    aborts = [t for t in proxy.targets() if t.startswith("DELETE ") and "uploadId=" in t]
    assert len(aborts) == 1
    assert not fs.exists(store.uri("aborted.bin"))


def test_writes_use_the_endpoint_and_credentials_reads_use(store, monkeypatch):
  proxy = store.fault_proxy()
  _through(proxy, store, monkeypatch)
  if store.kind == "s3":
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMTHEENVIRONMENT")
  sent = []
  real = http.request
  monkeypatch.setattr(http, "request",
                      lambda method, url, headers=None, *a, **k:
                      sent.append((method, url, headers or {})) or real(method, url, headers,
                                                                        *a, **k))
  fs.write_bytes(store.uri("env", "a.json"), b'{"a": 1}')
  assert fs.read_bytes(store.uri("env", "a.json")) == b'{"a": 1}'
  fs.delete(store.uri("env", "a.json"))
  assert not fs.exists(store.uri("env", "a.json"))
  assert {m for m, _, _ in sent} >= {"GET", "DELETE", "PUT" if store.kind == "s3" else "POST"}
  assert all(url.startswith(f"http://127.0.0.1:{proxy.port}/") for _, url, _ in sent)
  if store.kind == "s3":
    assert all("Credential=AKIDFROMTHEENVIRONMENT/" in h["Authorization"] for _, _, h in sent)
  assert proxy.counts()["requests_DELETE"] == 1
