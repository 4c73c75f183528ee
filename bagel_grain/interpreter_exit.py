"""The interpreter's exit waits, briefly, for our daemon threads to leave pyarrow's C++.

pyarrow reads an object in a bucket by calling back into Python (`pa.PythonFile` over
our ranged reads). When the interpreter finalizes, CPython stops a daemon thread the
moment it asks for the GIL; stopped inside such a callback, the thread unwinds through
pyarrow's C++ frames, which release a thread state Python has already let go, and the
process aborts ("PyGILState_Release: thread state ... must be current when releasing",
SIGABRT). Measured before this module: a script that took one batch of the demo from
S3 (50 ms a request, 0 workers) and returned aborted in 4 of 12 runs.

So the work of our daemon threads (a read-ahead call, an element computed inline) runs
inside `working()`, and an `atexit` hook, which runs before finalization: refuses new
requests (`check`, called by every HTTP request: `Exiting`), cuts the requests in flight
(the hooks given to `on_exit`), and waits at most `EXIT_WAIT_S` for every such thread to
be out of its work, in plain Python again. A stuck read is cut, not waited for, so the
exit stays quick (`close` and the exit never wait on a silent store).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from typing import Callable, Iterator

EXIT_WAIT_S = 2.0  # a row group decoded or an image resized takes well under this

_cond = threading.Condition()
_working = 0
_exiting = False
_hooks: list[Callable[[], None]] = []


class Exiting(OSError):
  """A request made while the interpreter exits: refused at once (nobody is left to take
  its answer). Not transient: the thread must leave its work now, not retry."""


def check() -> None:
  """Raises `Exiting` once the interpreter's exit has begun."""
  if _exiting:
    raise Exiting("the interpreter is exiting: no new request is sent")


def on_exit(hook: Callable[[], None]) -> None:
  """`hook()` runs at exit, before the wait: it ends the waits that work may be in."""
  _hooks.append(hook)


@contextlib.contextmanager
def working() -> Iterator[None]:
  """A daemon thread's unit of work, which the exit waits for (within `EXIT_WAIT_S`)."""
  global _working
  with _cond:
    _working += 1
  try:
    yield
  finally:
    with _cond:
      _working -= 1
      _cond.notify_all()


def _at_exit() -> None:
  global _exiting
  with _cond:
    _exiting = True
  for hook in _hooks:
    hook()
  deadline = time.monotonic() + EXIT_WAIT_S
  with _cond:
    while _working and (left := deadline - time.monotonic()) > 0:
      _cond.wait(left)


atexit.register(_at_exit)
