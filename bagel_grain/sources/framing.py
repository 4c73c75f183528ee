"""The byte framing of one converted record: a JSON header, then its binary blobs, no pickle.

Layout (all integers little-endian):

    b"BGR1"                 magic and format version
    u32 header_length
    header                  UTF-8 JSON, `header_length` bytes
    blob 0, blob 1, ...     raw bytes, concatenated, exactly as long as the header says

The header is `{"format": F, "fields": V, "blobs": [[path, size], ...], "origin": S}`:
`fields` is the record as JSON with `null` wherever a bytes value was; each blob
names that place by its path (dict keys and list indexes from the top) and its
size. Images keep their original encoded bytes. `origin` is the record id the
record was converted from (for audits; not read back).

Formats:
- `parquet_row`: a parquet row as the family reads it, `{column: value}`.
- `jsonl_line`: `{"line": <the JSONL line, verbatim bytes>, "files": {relative path:
  <bytes>}, "file_errors": {relative path: drop reason}}` -- the image and video
  files the line references, under the relative path the line spells; decodes to
  `LineWithFiles`.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Mapping

from bagel_grain.drops import DropReason

MAGIC = b"BGR1"
_PREFIX = struct.Struct("<4sI")
PARQUET_ROW = "parquet_row"
JSONL_LINE = "jsonl_line"
_FORMATS = (PARQUET_ROW, JSONL_LINE)
_REASONS = frozenset(DropReason)


class FramingError(ValueError):
  """A record that is not a well-formed framed record (truncated, corrupt, foreign)."""


@dataclasses.dataclass(frozen=True)
class LineWithFiles:
  """A VLM JSONL line with the files it references embedded.

  `files` maps the relative path as the line spells it to the file's bytes. A
  video frame folder `dir/` is embedded as its frames `dir/<name>`. A referenced
  file that is not there is simply absent; one the VLM family would refuse or fail
  on before opening it (a path leaving `data_dir`, a missing frame folder, an
  unreadable frame) is listed in `file_errors` with that drop reason.
  """

  line: bytes
  files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
  file_errors: Mapping[str, DropReason] = dataclasses.field(default_factory=dict)


def _strip_blobs(value: Any, path: list, blobs: list[tuple[list, bytes]]) -> Any:
  """`value` with bytes replaced by None; the bytes and their paths appended to `blobs`."""
  if isinstance(value, (bytes, bytearray, memoryview)):
    blobs.append((list(path), bytes(value)))
    return None
  if isinstance(value, Mapping):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise TypeError(f"mapping key {key!r} is not a string")
      out[key] = _strip_blobs(item, path + [key], blobs)
    return out
  if isinstance(value, (list, tuple)):
    return [_strip_blobs(item, path + [i], blobs) for i, item in enumerate(value)]
  if value is None or isinstance(value, (str, bool, int, float)):
    return value
  raise TypeError(f"value of type {type(value).__name__} cannot be framed")


def encode(fields: Mapping[str, Any] | LineWithFiles, *, origin: str = "") -> bytes:
  """Frames a parquet row (a mapping of JSON values and bytes) or a `LineWithFiles`.

  TypeError for a value JSON cannot hold (other than bytes).
  """
  kind = PARQUET_ROW
  if isinstance(fields, LineWithFiles):
    kind = JSONL_LINE
    fields = {"line": fields.line, "files": dict(fields.files),
              "file_errors": dict(fields.file_errors)}
  if not isinstance(fields, Mapping):
    raise TypeError(f"a record is a mapping, not {type(fields).__name__}")
  blobs: list[tuple[list, bytes]] = []
  stripped = _strip_blobs(fields, [], blobs)
  header = json.dumps({"format": kind, "fields": stripped,
                       "blobs": [[path, len(data)] for path, data in blobs], "origin": origin},
                      ensure_ascii=False, separators=(",", ":")).encode("utf-8")
  return b"".join([_PREFIX.pack(MAGIC, len(header)), header] + [data for _, data in blobs])


def _place(fields: Any, path: Any, data: bytes) -> None:
  if not isinstance(path, list) or not path:
    raise FramingError(f"blob path {path!r} is not a non-empty list")
  container = fields
  for step in path[:-1]:
    container = _step(container, step, path)
  last = path[-1]
  _step(container, last, path)  # checks the place exists
  if container[last] is not None:
    raise FramingError(f"blob path {path!r} does not point at a placeholder")
  container[last] = data


def _step(container: Any, step: Any, path: list) -> Any:
  if isinstance(container, dict) and isinstance(step, str) and step in container:
    return container[step]
  if (isinstance(container, list) and isinstance(step, int) and not isinstance(step, bool)
      and 0 <= step < len(container)):
    return container[step]
  raise FramingError(f"blob path {path!r} does not exist in the fields")


def origin(data: bytes) -> str:
  """The `origin` a framed record names, from its header alone (FramingError if none)."""
  view = memoryview(data)
  if len(view) < _PREFIX.size or _PREFIX.unpack_from(view)[0] != MAGIC:
    raise FramingError("not a framed record")
  body = _PREFIX.size + _PREFIX.unpack_from(view)[1]
  try:
    header = json.loads(bytes(view[_PREFIX.size:body]).decode("utf-8"))
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise FramingError(f"header is not JSON: {e}") from None
  if not isinstance(header, dict) or not isinstance(header.get("origin"), str):
    raise FramingError("header names no `origin`")
  return header["origin"]


def decode(data: bytes) -> tuple[str, Any]:
  """(format, fields) of a framed record; `jsonl_line` fields come as `LineWithFiles`.

  Raises FramingError, never anything else, for bytes that are not a whole record.
  """
  view = memoryview(data)
  if len(view) < _PREFIX.size:
    raise FramingError(f"record of {len(view)} bytes is shorter than its prefix")
  magic, header_length = _PREFIX.unpack_from(view)
  if magic != MAGIC:
    raise FramingError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
  body = _PREFIX.size + header_length
  if body > len(view):
    raise FramingError(f"header of {header_length} bytes overruns the {len(view)}-byte record")
  try:
    header = json.loads(bytes(view[_PREFIX.size:body]).decode("utf-8"))
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise FramingError(f"header is not JSON: {e}") from None
  if not isinstance(header, dict) or header.get("format") not in _FORMATS:
    raise FramingError("header lacks a known `format`")
  blobs, fields = header.get("blobs"), header.get("fields")
  if not isinstance(blobs, list) or not all(
      isinstance(b, list) and len(b) == 2 and isinstance(b[1], int) and b[1] >= 0
      for b in blobs):
    raise FramingError("header `blobs` is not a list of [path, size]")
  if not isinstance(fields, dict):
    raise FramingError("header `fields` is not a mapping")
  if body + sum(size for _, size in blobs) != len(view):
    raise FramingError(f"blob sizes do not add up to the record's {len(view)} bytes")
  position = body
  for path, size in blobs:
    _place(fields, path, bytes(view[position:position + size]))
    position += size
  if header["format"] == JSONL_LINE:
    return JSONL_LINE, _line_with_files(fields)
  return PARQUET_ROW, fields


def _line_with_files(fields: Any) -> LineWithFiles:
  if not (isinstance(fields, dict) and isinstance(fields.get("line"), bytes)
          and isinstance(fields.get("files"), dict)
          and all(isinstance(v, bytes) for v in fields["files"].values())
          and isinstance(fields.get("file_errors"), dict)
          and all(isinstance(v, str) and v in _REASONS for v in fields["file_errors"].values())):
    raise FramingError("a jsonl_line record needs bytes `line`, `files`, and `file_errors` "
                       "holding drop reasons")
  errors = {path: DropReason(v) for path, v in fields["file_errors"].items()}
  return LineWithFiles(fields["line"], fields["files"], errors)
