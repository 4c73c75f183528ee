"""The exceptions a user can act on, each naming where the problem is."""

from __future__ import annotations


class BagelGrainError(Exception):
  """Base class of every error bagel_grain raises on purpose."""


class ConfigError(BagelGrainError, ValueError):
  """A configuration that cannot describe a pipeline; names the file, group and key."""

  def __init__(self, message: str, *, file: str | None = None, group: str | None = None,
               key: str | None = None):
    self.file, self.group, self.key = file, group, key
    where = ", ".join(
        f"{label} {value!r}" for label, value in
        (("file", file), ("group", group), ("key", key)) if value is not None)
    super().__init__(f"{message} ({where})" if where else message)


class DatasetError(BagelGrainError):
  """A dataset that cannot be read at build time; names the file and field."""

  def __init__(self, message: str, *, file: str | None = None, field: str | None = None):
    self.file, self.field = file, field
    where = ", ".join(f"{label} {value!r}" for label, value in
                      (("file", file), ("field", field)) if value is not None)
    super().__init__(f"{message} ({where})" if where else message)


class GroupExhaustedError(BagelGrainError):
  """A group keeps yielding nothing usable: stop instead of looping forever."""


class StateMismatchError(BagelGrainError):
  """A saved iterator state belongs to a differently shaped stream."""


class StreamEndedError(BagelGrainError):
  """A finite stream (`num_epochs`) ended before the row a command asked for."""


class UnsupportedOperationError(BagelGrainError, TypeError):
  """A Grain operation that cannot apply to the packed stream; says what to use instead."""


class StorageUnavailableError(BagelGrainError):
  """Storage kept failing (network, timeouts, throttling) past `storage_timeout_s`.

  Nothing was dropped or consumed: the iterator is where it was before the
  `next()` that raised, and a later `next()` (once storage is back) reads the
  same record again; or restore a saved state.
  """

  def __init__(self, what: str, error: str, waited_s: float, attempts: int):
    self.what, self.error, self.waited_s, self.attempts = what, error, waited_s, attempts
    super().__init__(
        f"storage did not answer reading {what}: tried {attempts} times over {waited_s:.1f} s "
        f"(`storage_timeout_s`), last error: {error}. No record was lost: the iterator is "
        "where it was before this next(); call next() again once storage is back, or "
        "raise `storage_timeout_s` to wait longer.")

  def __reduce__(self):  # crosses from worker processes as itself
    return type(self), (self.what, self.error, self.waited_s, self.attempts)


class StorageWriteError(BagelGrainError):
  """A write (or delete) of an object that storage kept failing past its deadline.

  Nothing partial is left where a reader looks: an object appears only once whole.
  """

  def __init__(self, path: str, error: str, waited_s: float, attempts: int):
    self.path, self.error, self.waited_s, self.attempts = path, error, waited_s, attempts
    super().__init__(
        f"storage did not answer writing {path}: one request was tried {attempts} times over "
        f"{waited_s:.1f} s, last error: {error}. The object was not written (it appears only "
        "once whole); run the command again once storage is back.")

  def __reduce__(self):
    return type(self), (self.path, self.error, self.waited_s, self.attempts)
