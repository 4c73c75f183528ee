"""A process that ends while a read-ahead thread is inside pyarrow's C++ exits cleanly.

pyarrow reads an object in a bucket by calling back into our Python reads. A daemon
thread that CPython stops during finalization inside such a callback aborts the
process (SIGABRT, "PyGILState_Release ... must be current"). The child below makes it
certain rather than likely: its read-ahead thread's request is held for a second
inside pyarrow's footer read, and the main thread returns at once; an object of
`__main__` whose `__del__` sleeps keeps the finalization going while the held thread
wakes up. Before `interpreter_exit` the child aborted every time.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from object_store import LocalObjectStore

HELD_S = 1.0


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_exit_during_a_read_inside_pyarrow_does_not_abort(tmp_path, kind):
  local = tmp_path / "t.parquet"
  pq.write_table(pa.table({"x": list(range(1000))}), local)
  with LocalObjectStore(kind) as store:
    store.upload_file(local, "t.parquet")
    env = {**os.environ, **store.environment(),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                          str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, __file__, store.uri("t.parquet")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "held inside pyarrow" in done.stdout  # the exit did happen during the read


class _SlowFinalization:
  def __del__(self):
    time.sleep(HELD_S * 2)  # finalizing, with the GIL let go: the held thread wakes now


def _child(uri: str) -> None:
  # pylint: disable=import-outside-toplevel
  from bagel_grain import fs
  from bagel_grain.remote import http
  from bagel_grain.sources import readahead

  held = threading.Event()
  real = http.request

  def holding_request(*args, **kwargs):
    if threading.current_thread().name.startswith("exit-test"):
      held.set()
      time.sleep(HELD_S)
    return real(*args, **kwargs)

  pool = readahead.DaemonThreads(1, "exit-test")
  info = fs.file_info(uri)  # the handle's HEAD, made here, not held
  http.request = holding_request
  pool.submit(lambda: pq.ParquetFile(fs.open_random_access(uri, pin=info)).metadata)
  assert held.wait(60)
  print("held inside pyarrow", flush=True)


if __name__ == "__main__":
  _keep = _SlowFinalization()
  _child(sys.argv[1])
