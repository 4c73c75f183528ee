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


class UnsupportedOperationError(BagelGrainError, TypeError):
  """A Grain operation that cannot apply to the packed stream; says what to use instead."""
