"""What the object-store clients' writes share: the bytes to write, and how a request retries.

A client's `upload(bucket, key, source, retry)` reads `source` one part at a time
(never the whole of a large object in memory) and passes each request to `retry`
on its own, so a transient fault costs one request again, not the whole object;
the caller (`bagel_grain.fs`) decides how long a request may keep failing.
"""

from __future__ import annotations

import dataclasses
from typing import BinaryIO, Callable, TypeVar

from bagel_grain.remote.http import DefiniteError

T = TypeVar("T")
Retry = Callable[[Callable[[], T]], T]


class UploadCorrupted(DefiniteError):
  """The store reports other bytes than those sent (its checksum of the object differs)."""


@dataclasses.dataclass
class UploadSource:
  """`size` bytes of a seekable binary file: what an upload writes."""

  file: BinaryIO
  size: int
  name: str

  def read(self, offset: int, length: int) -> bytes:
    self.file.seek(offset)
    data = self.file.read(length)
    if len(data) != length:
      raise OSError(f"{self.name} is shorter than the {self.size} bytes it had when its "
                    f"upload started (it changed while being uploaded)")
    return data
