"""The first batch from a bucket waits on few serial round trips (issue 28, point 3).

On a bucket each request costs a round trip (50 ms and more); what the first batch
waits on is the number of them made one after the other. This counts them without a
clock: every request waits at a gate, and the gate lets through all the requests that
are waiting together (a wave) once no other has arrived for a while. Requests made
at once share a wave; a request that needed another's answer waits for the next one.
The waves from the `build_pipeline` call to the first batch in hand are the serial
round trips. Counted in a process of its own (0 workers), whose `http.request` the
gate replaces.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bagel_grain.config import config_from_dict
from bagel_grain.tokenizer import load_tokenizer
from bagel_grain.pipeline import build_pipeline
from bagel_grain.remote import http
from conftest import CONFIGS
from object_store import LocalObjectStore
from shipped_demo import shipped_demo_raw

# Build: the folders' listings, the JSONL's HEAD and its index stamp, together; the
# parquet files whole (a small dataset: in place of their footers; the listing gave their
# sizes: no HEAD), `parquet_info`, and the JSONL whole (small: its scan, tail and lines),
# together. Iteration: every group's first elements at once (a parquet row group: in hand,
# or for a larger dataset its column chunks in one request, its footer the build's; a
# JSONL line: in hand) with their images: the JSONL's images alone, now. Before issue 28's round the demo took 20; 13 with the stream's identity (the
# manifests) read again after the build; 5 once the build's own reads made the identity;
# now 3.
MAX_SERIAL_ROUND_TRIPS = 3
QUIET_S = 0.3  # a wave is let through once no request has joined it for this long


class Waves:
  """Wraps `http.request`: requests are let through in waves, which it counts."""

  def __init__(self, request):
    self._request = request
    self._cond = threading.Condition()
    self._waiting = 0
    self._released = 0  # waves let through so far
    self._last_arrival = 0.0
    self._closed = False
    self.counting = False
    self.waves = 0  # while `counting`
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def request(self, *args, **kwargs):
    with self._cond:
      wave = self._released
      self._waiting += 1
      self._last_arrival = time.monotonic()
      self._cond.notify_all()
      while self._released == wave and not self._closed:
        self._cond.wait()
    return self._request(*args, **kwargs)

  def _run(self) -> None:
    with self._cond:
      while not self._closed:
        if not self._waiting:
          self._cond.wait()
          continue
        quiet = self._last_arrival + QUIET_S - time.monotonic()
        if quiet > 0:
          self._cond.wait(quiet)
          continue
        self._waiting = 0
        self._released += 1
        self.waves += self.counting
        self._cond.notify_all()

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    self._thread.join(timeout=5)


def serial_round_trips(root: str, demo_dir: Path) -> int:
  """In this process: the waves from the `build_pipeline` call to the first batch."""
  cfg = config_from_dict(shipped_demo_raw(demo_dir, root), file="remote.yaml",
                         base_dir=str(CONFIGS))
  tokenizer = load_tokenizer(str(demo_dir / "tokenizer"))
  waves = Waves(http.request)
  http.request = waves.request
  waves.counting = True
  it = iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=0))
  try:
    next(it)
    waves.counting = False
  finally:
    waves.close()  # the reads in flight go on as usual, and close ends them as usual
    it.close()
  return waves.waves


@pytest.fixture(scope="module")
def s3_demo(demo_dir):
  with LocalObjectStore("s3") as store:
    yield store, store.upload(str(demo_dir), "demo")


def test_the_first_batch_from_a_bucket_waits_on_few_serial_round_trips(s3_demo, demo_dir):
  store, root = s3_demo
  here = os.path.dirname(os.path.abspath(__file__))
  env = {**os.environ, **store.environment(),
         "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}
  out = subprocess.run([sys.executable, __file__, root, str(demo_dir)], env=env,
                       capture_output=True, text=True, timeout=300, check=True)
  waves = json.loads(out.stdout.strip().splitlines()[-1])["serial_round_trips"]
  assert 0 < waves <= MAX_SERIAL_ROUND_TRIPS, waves


if __name__ == "__main__":
  print(json.dumps({"serial_round_trips": serial_round_trips(sys.argv[1], Path(sys.argv[2]))}),
        flush=True)
