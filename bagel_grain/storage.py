"""Storage that blips: a transient failure is waited out, a definite answer is final.

An object store answers a read in one of three ways, and each has its own fate:

- the bytes;
- a definite answer about the object (404 / `FileNotFoundError`, not a regular
  file, too large, access refused): the caller drops the record with the reason;
- a transient failure (a refused or reset connection, a timeout, a throttling or
  5xx answer): `RetryPolicy.call` tries again, with exponential backoff and
  jitter, until the storage deadline; the stream waits and drops nothing. Past
  the deadline it raises `StorageUnavailableError`, which leaves the iterator
  where it was (the batching stage puts its position back), so a later `next()`
  reads the same record again.

The deadline counts from the start of the element being computed (an element
reads a record and then its files) and holds inside each request too (the
request is cut when it passes: `fs.deadline_scope`), so retries, slow answers
and reads ahead waited on never keep one element longer than
`storage_timeout_s`, which `policy_for` keeps below `element_timeout_s`: a
storage outage is always this retriable error, never the fetcher's fatal stall
(which is meant for a decode that hangs). The object-store client does not
retry on its own (`remote.http`): this loop, which counts and logs, is the one
that waits. Once the fetcher is closed (`element_scope(abandoned)`), a failed
read is not tried again.

Reads started ahead of need (`sources.readahead`) try once, under a deadline of
their own: a failure there is forgotten and the consumer reads again under this
policy.

Counters (`ElementStorage`) are kept per element computed and summed per group
by the fetcher; one log line says when storage starts failing, one when it is
back, per process (not one per request).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import random
import threading
import time
from typing import Callable, Iterator, TypeVar

from bagel_grain.errors import StorageUnavailableError
from bagel_grain.remote.http import DefiniteError, deadline_scope

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
_FIRST_WAIT_S = 0.1
_LONGEST_WAIT_S = 5.0
T = TypeVar("T")

# Words in pyarrow's (AWS SDK, google-cloud-cpp, curl) messages for a failure that may pass.
_TRANSIENT_MARKERS = (
    "NETWORK_CONNECTION", "curlCode", "CURL error", "UNAVAILABLE", "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED", "SlowDown", "Throttl", "THROTTL", "SLOW_DOWN", "HTTP status 5",
    "status code: 5", "INTERNAL_FAILURE", "SERVICE_UNAVAILABLE", "REQUEST_TIMEOUT",
    "Connection reset", "Connection refused", "timed out", "Timeout was reached",
    "Broken pipe", "Server returned nothing", "partial file")
_TRANSIENT_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                     errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}


def is_transient(error: BaseException) -> bool:
  """True for a failure that may pass if tried again (network, timeout, throttling, 5xx);
  False for a definite answer (no such object, access refused) and for local I/O errors."""
  if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, DefiniteError)):
    return False
  if isinstance(error, (ConnectionError, TimeoutError)):
    return True
  if not isinstance(error, OSError):
    return False
  if error.errno in _TRANSIENT_ERRNOS:
    return True
  message = str(error)
  return any(marker in message for marker in _TRANSIENT_MARKERS)


@dataclasses.dataclass
class ElementStorage:
  """What storage cost while computing one element (or a sum of them): retries made, and
  seconds spent waiting on storage that failed (backoff sleeps and the failed attempts)."""

  retries: int = 0
  wait_s: float = 0.0

  def add(self, other: ElementStorage) -> None:
    self.retries += other.retries
    self.wait_s += other.wait_s

  def to_json(self) -> dict[str, float]:
    return {"retries": self.retries, "wait_s": round(self.wait_s, 3)}


class GroupCounts:
  """This process's storage counters per group name (all its pipelines): what
  `pipeline_stats` reports under `storage`. Workers' costs arrive with their results."""

  def __init__(self):
    self._lock = threading.Lock()
    self._groups: dict[str, ElementStorage] = {}

  def add(self, group: str, spent: ElementStorage) -> None:
    if not spent.retries and not spent.wait_s:
      return
    with self._lock:
      self._groups.setdefault(group, ElementStorage()).add(spent)

  def to_json(self) -> dict[str, dict[str, float]]:
    with self._lock:
      return {name: counts.to_json() for name, counts in sorted(self._groups.items())}

  def clear(self) -> None:
    with self._lock:
      self._groups.clear()


COUNTS = GroupCounts()


class _ThreadState(threading.local):
  single_attempt = False  # a read-ahead thread: fail at once, the consumer reads again
  element_start: float | None = None
  spent: ElementStorage | None = None
  abandoned: threading.Event | None = None  # set: nobody waits for this element any more
  retrying = False  # inside a `RetryPolicy.call`: its loop tries the whole read again


_THREAD = _ThreadState()


def single_attempts() -> None:
  """Makes this thread's reads try once (read-ahead threads, as their pool initializer)."""
  _THREAD.single_attempt = True


@contextlib.contextmanager
def element_scope(abandoned: threading.Event | None = None) -> Iterator[ElementStorage]:
  """Around one element's computation: its reads share one deadline (from now), and their
  retries are counted in the yielded `ElementStorage`. Once `abandoned` is set (the
  fetcher closed), a failed read is not tried again."""
  outer = _THREAD.element_start, _THREAD.spent, _THREAD.abandoned
  spent = ElementStorage()
  _THREAD.element_start, _THREAD.spent, _THREAD.abandoned = time.monotonic(), spent, abandoned
  try:
    yield spent
  finally:
    _THREAD.element_start, _THREAD.spent, _THREAD.abandoned = outer


def element_deadline(policy: RetryPolicy) -> float:
  """When `policy`'s retries for the element this thread computes end (`time.monotonic()`)."""
  now = time.monotonic()
  return min(now, _THREAD.element_start or now) + policy.timeout_s


class _Outage:
  """One log line when reads start failing in this process, one when they are back: a
  read that had failed succeeds (a read that never failed proves little: it may have
  been served from a cache), or reads succeed with no failure for `_QUIET_S`."""

  _QUIET_S = 10.0

  def __init__(self):
    self._lock = threading.Lock()
    self._since: float | None = None
    self._last = 0.0
    self._failures = 0

  def failed(self, what: str, error: BaseException, timeout_s: float) -> None:
    with self._lock:
      self._failures += 1
      self._last = time.monotonic()
      if self._since is not None:
        return
      self._since = self._last
    log.warning("storage is failing (%s: %s); retrying with backoff for up to %g s per "
                "element, the stream waits", what, _short(error), timeout_s)

  def succeeded(self, recovered: bool) -> None:
    if self._since is None:  # read without the lock: the common case costs nothing
      return
    with self._lock:
      if self._since is None or (not recovered
                                 and time.monotonic() - self._last < self._QUIET_S):
        return
      since, failures, self._since, self._failures = self._since, self._failures, None, 0
    log.warning("storage is back after %.1f s (%d failed attempts in this process)",
                time.monotonic() - since, failures)


OUTAGE = _Outage()


def _short(error: BaseException, limit: int = 300) -> str:
  text = f"{type(error).__name__}: {error}"
  return text if len(text) <= limit else text[:limit] + "..."


def policy_for(storage_timeout_s: float, element_timeout_s: float) -> RetryPolicy:
  """The policy for a pipeline: retries end at `storage_timeout_s`, or at 80 % of
  `element_timeout_s` if that is sooner, so that the storage error comes first."""
  return RetryPolicy(timeout_s=min(storage_timeout_s, 0.8 * element_timeout_s))


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """How long a transient storage failure is retried (`timeout_s`, from the start of the
  element being computed, or of the call outside one) and how the waits grow."""

  timeout_s: float = DEFAULT_TIMEOUT_S
  first_wait_s: float = _FIRST_WAIT_S
  longest_wait_s: float = _LONGEST_WAIT_S

  def call(self, what: str, read: Callable[[], T]) -> T:
    """`read()`, tried again on transient failures; `what` names the object in errors.

    Raises what `read` raises for a definite answer, and StorageUnavailableError once
    the deadline has passed."""
    start = time.monotonic()
    deadline = element_deadline(self)
    attempt = 0
    while True:
      tried = time.monotonic()
      outer, _THREAD.retrying = _THREAD.retrying, True
      try:
        with deadline_scope(deadline):  # holds inside each request, not only between them
          value = read()
      except Exception as e:  # pylint: disable=broad-except  # sorted just below
        if not is_transient(e):
          raise
        now = time.monotonic()
        OUTAGE.failed(what, e, self.timeout_s)
        if _THREAD.single_attempt or (_THREAD.abandoned is not None
                                      and _THREAD.abandoned.is_set()):
          raise
        if now >= deadline:
          raise StorageUnavailableError(what, _short(e), now - start, attempt + 1) from e
        wait = min(self.longest_wait_s, self.first_wait_s * 2 ** attempt)
        wait = min(random.uniform(wait / 2, wait), max(0.0, deadline - now))  # jitter
        time.sleep(wait)
        attempt += 1
        if _THREAD.spent is not None:
          _THREAD.spent.retries += 1
          _THREAD.spent.wait_s += time.monotonic() - tried
        continue
      finally:
        _THREAD.retrying = outer
      OUTAGE.succeeded(recovered=attempt > 0)
      return value


_BUILDS: list[RetryPolicy] = [RetryPolicy()]  # innermost last: see `build_scope`


@contextlib.contextmanager
def build_scope(policy: RetryPolicy) -> Iterator[None]:
  """While a pipeline is built, the reads that are not inside an element's (its listings,
  footers, index files, probes, HEADs) wait out transient failures under its `policy`.
  Process-wide, not per thread: a build reads on pools of threads."""
  _BUILDS.append(policy)
  try:
    yield
  finally:
    _BUILDS.remove(policy)


def retried(what: str, read: Callable[[], T]) -> T:
  """`read()` of the storage layer (`fs`): inside a `RetryPolicy.call` or an element's
  computation, once (that loop, or the element's own, tries again); otherwise under the
  policy of the build in progress (`build_scope`; the default deadline outside one), so
  that a transient failure at build time (a 503, a reset connection) is waited out as
  in a stream, and one past the deadline is `StorageUnavailableError` naming `what`."""
  if _THREAD.retrying or _THREAD.element_start is not None:  # an element's code decides
    return read()
  return _BUILDS[-1].call(what, read)
