"""A FIFO that cannot hang a test: if something opens it for reading, a writer comes."""

import contextlib
import os
import threading

RESCUE_AFTER_S = 5.0  # a reader still blocked by then is a failure, not a hang


@contextlib.contextmanager
def fifo(path, content=b"rescued: true\n"):
  """Makes a FIFO at `path`. Code that opens it and waits for a writer gets `content`
  after a few seconds (so it fails its test instead of hanging); code that refuses it
  unopened never sees a writer."""
  os.mkfifo(path)
  done = threading.Event()
  rescued = []

  def rescue():
    while not done.wait(RESCUE_AFTER_S):
      try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody is reading
      except OSError:
        continue
      rescued.append(path)
      with os.fdopen(fd, "wb") as f:
        f.write(content)
      return

  thread = threading.Thread(target=rescue, daemon=True)
  thread.start()
  try:
    yield rescued  # non-empty when a reader had to be rescued
  finally:
    done.set()
    thread.join()
