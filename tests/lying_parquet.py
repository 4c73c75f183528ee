"""Parquet files whose footer lies about their row counts, for tests and the soak.

The footer is Thrift (compact protocol); this reads it into plain tuples, edits
row counts and writes it back, the data pages untouched. Field ids follow
parquet.thrift: FileMetaData 3 = num_rows, 4 = row_groups; RowGroup 1 = columns,
3 = num_rows; ColumnChunk 3 = meta_data; ColumnMetaData 5 = num_values.
"""

from __future__ import annotations

import struct

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = (
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)


class _Reader:
  def __init__(self, data: bytes):
    self.data, self.pos = data, 0

  def byte(self) -> int:
    self.pos += 1
    return self.data[self.pos - 1]

  def varint(self) -> int:
    shift = result = 0
    while True:
      b = self.byte()
      result |= (b & 0x7F) << shift
      shift += 7
      if not b & 0x80:
        return result

  def zigzag(self) -> int:
    n = self.varint()
    return (n >> 1) ^ -(n & 1)

  def value(self, kind: int):
    if kind in (_TRUE, _FALSE):
      return kind == _TRUE
    if kind == _BYTE:
      return self.byte()
    if kind in (_I16, _I32, _I64):
      return self.zigzag()
    if kind == _DOUBLE:
      self.pos += 8
      return struct.unpack("<d", self.data[self.pos - 8:self.pos])[0]
    if kind == _BINARY:
      n = self.varint()
      self.pos += n
      return self.data[self.pos - n:self.pos]
    if kind in (_LIST, _SET):
      header = self.byte()
      size, elem = header >> 4, header & 0x0F
      if size == 15:
        size = self.varint()
      if elem in (_TRUE, _FALSE):
        return (elem, [self.byte() == 1 for _ in range(size)])
      return (elem, [self.value(elem) for _ in range(size)])
    if kind == _MAP:
      size = self.varint()
      if not size:
        return (0, 0, [])
      types = self.byte()
      kt, vt = types >> 4, types & 0x0F
      return (kt, vt, [(self.value(kt), self.value(vt)) for _ in range(size)])
    if kind == _STRUCT:
      fields, last = [], 0
      while True:
        header = self.byte()
        if header == _STOP:
          return fields
        delta, ftype = header >> 4, header & 0x0F
        fid = last + delta if delta else self.zigzag()
        fields.append([fid, ftype, self.value(ftype)])
        last = fid
    raise ValueError(f"thrift type {kind}")


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    if n < 0x80:
      out.append(n)
      return bytes(out)
    out.append((n & 0x7F) | 0x80)
    n >>= 7


def _zigzag(n: int) -> bytes:
  return _varint((n << 1) ^ (n >> 63))


def _write(kind: int, value) -> bytes:
  if kind in (_TRUE, _FALSE):
    return b""  # a struct field's bool lives in its header
  if kind == _BYTE:
    return bytes([value])
  if kind in (_I16, _I32, _I64):
    return _zigzag(value)
  if kind == _DOUBLE:
    return struct.pack("<d", value)
  if kind == _BINARY:
    return _varint(len(value)) + value
  if kind in (_LIST, _SET):
    elem, items = value
    head = bytes([(len(items) << 4) | elem]) if len(items) < 15 else (
        bytes([0xF0 | elem]) + _varint(len(items)))
    if elem in (_TRUE, _FALSE):
      return head + bytes(1 if v else 2 for v in items)
    return head + b"".join(_write(elem, v) for v in items)
  if kind == _MAP:
    kt, vt, items = value
    if not items:
      return b"\x00"
    return (_varint(len(items)) + bytes([(kt << 4) | vt])
            + b"".join(_write(kt, k) + _write(vt, v) for k, v in items))
  if kind == _STRUCT:
    out, last = bytearray(), 0
    for fid, ftype, v in value:
      if ftype in (_TRUE, _FALSE):
        ftype = _TRUE if v else _FALSE
      delta = fid - last
      out += bytes([(delta << 4) | ftype]) if 0 < delta <= 15 else bytes([ftype]) + _zigzag(fid)
      out += _write(ftype, v)
      last = fid
    return bytes(out) + b"\x00"
  raise ValueError(f"thrift type {kind}")


def _field(struct_fields, fid):
  return next(f for f in struct_fields if f[0] == fid)


def read_footer(path) -> tuple[bytes, list]:
  """(the bytes before the footer, the footer as nested [id, type, value] fields)."""
  data = open(path, "rb").read()
  assert data[-4:] == b"PAR1"
  length = struct.unpack("<I", data[-8:-4])[0]
  start = len(data) - 8 - length
  return data[:start], _Reader(data[start:len(data) - 8]).value(_STRUCT)


def write_footer(path, body: bytes, footer: list) -> None:
  encoded = _write(_STRUCT, footer)
  with open(path, "wb") as f:
    f.write(body + encoded + struct.pack("<I", len(encoded)) + b"PAR1")


def claim_rows(path, row_group: int, rows: int, *, consistent: bool = False) -> None:
  """Rewrites `path`'s footer so `row_group` claims `rows` rows (the file's total follows).

  `consistent`: also each column chunk's value count, so the footer agrees with itself
  and only reading the data shows the lie.
  """
  body, footer = read_footer(path)
  groups = _field(footer, 4)[2][1]
  group = groups[row_group]
  count = _field(group, 3)
  was = count[2]
  count[2] = rows
  _field(footer, 3)[2] += rows - was
  if consistent:
    for chunk in _field(group, 1)[2][1]:
      meta = _field(chunk, 3)[2]
      values = _field(meta, 5)
      values[2] = rows if values[2] == was else values[2] + rows - was
  write_footer(path, body, footer)
