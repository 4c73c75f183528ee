"""A deadline for tests that wait on processes: a hang fails the test instead of stalling CI."""

import contextlib
import signal


@contextlib.contextmanager
def deadline(seconds: int):
  """Raises TimeoutError in the main thread after `seconds`."""
  def expired(signum, frame):
    raise TimeoutError(f"still running after {seconds} s")
  previous = signal.signal(signal.SIGALRM, expired)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
