"""A prepared sample's bytes between a worker and the main process, without pickle.

Unpickling a `PreparedSample` (three dataclasses, about twenty numpy arrays, each rebuilt
by numpy's reducer) was the largest part of the main process's pump. Here its metadata is
one struct-packed header and its arrays are raw buffers (placed in the worker's slab or
sent over its socket, as pickle's out-of-band buffers are); the main process rebuilds
each array as a view of its buffer. Arrays shared between fields (an edit chain's VAE
views of one image) stay shared, as pickle keeps them. Anything else (a dropped record,
an error, another pipeline's element) goes as a pickle: `encode` returns None for it.

Header: magic, group, index, epoch, packed_size, image_tokens, the sample's row usage
(`PreparedSample.usage`, worked out in the worker: the packer asks for it at once, and its
six numbers cost less to read than to work out again), the counts of VAE images, distinct
arrays and notes; then the record id and each note (length-prefixed UTF-8), each distinct
array's dtype and shape, and for each field the distinct array it is.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from typing import Sequence

import numpy as np

from bagel_grain.drops import Note
from bagel_grain.packing.layout import SampleLayout
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.row import Usage
from bagel_grain.sample import SampleKey

MAGIC = b"BGS2"  # a pickle starts with b"\x80"
_FIXED = struct.Struct("<4sqqqqqqqqqqqIII")
_LENGTH = struct.Struct("<I")
_MAX_DIMS = 4
_ARRAY = struct.Struct(f"<4sB{_MAX_DIMS}q")  # dtype.str, ndim, shape (padded)
_FIELDS = tuple(f.name for f in dataclasses.fields(SampleLayout) if f.name != "vae_images")
_DTYPES: dict[bytes, np.dtype] = {}
_USAGE = tuple(f.name for f in dataclasses.fields(Usage))


def _text(value: str) -> bytes:
  raw = value.encode("utf-8", "surrogatepass")
  return _LENGTH.pack(len(raw)) + raw


def encode(value) -> tuple[bytes, list[pickle.PickleBuffer]] | None:
  """The header and buffers of a `PreparedSample` of plain parts, else None (pickle it)."""
  if type(value) is not PreparedSample or type(value.layout) is not SampleLayout:
    return None
  key, layout = value.key, value.layout
  scalars = (key.group, key.index, key.epoch, value.packed_size, value.image_tokens)
  if (type(key) is not SampleKey or type(key.record) is not str
      or any(type(s) is not int for s in scalars)
      or any(type(n) is not Note for n in value.notes) or type(layout.vae_images) is not tuple):
    return None
  arrays = [getattr(layout, name) for name in _FIELDS] + list(layout.vae_images)
  distinct: dict[int, int] = {}
  parts, buffers = [], []
  for array in arrays:
    if id(array) in distinct:
      continue
    if (type(array) is not np.ndarray or not array.flags.c_contiguous
        or array.dtype.hasobject or array.ndim > _MAX_DIMS or len(array.dtype.str) > 4):
      return None
    distinct[id(array)] = len(buffers)
    buffers.append(pickle.PickleBuffer(array))
    shape = array.shape + (0,) * (_MAX_DIMS - array.ndim)
    parts.append(_ARRAY.pack(array.dtype.str.encode(), array.ndim, *shape))
  usage = value.usage
  header = [_FIXED.pack(MAGIC, *scalars, *(getattr(usage, name) for name in _USAGE),
                        len(layout.vae_images), len(buffers), len(value.notes)),
            _text(key.record)]
  header += [_text(note.value) for note in value.notes]
  header += parts
  header.append(struct.pack(f"<{len(arrays)}I", *(distinct[id(a)] for a in arrays)))
  return b"".join(header), buffers


def is_sample(payload: bytes) -> bool:
  return payload[:4] == MAGIC


def _made(cls, fields: dict):
  """An instance of a (frozen) dataclass with `fields`, made as unpickling makes it."""
  instance = object.__new__(cls)
  instance.__dict__.update(fields)
  return instance


def decode(payload: bytes, buffers: Sequence, offsets: Sequence[int] | None = None
           ) -> PreparedSample:
  """The sample `encode` described; its arrays are read-only views of `buffers`
  (numpy arrays of bytes, or bytes), or with `offsets`, of the one array of bytes
  `buffers` at those offsets (a slab's region, `MainSlab.region`: no view per buffer)."""
  (_, group, index, epoch, packed_size, image_tokens, *usage, n_vae, n_arrays, n_notes
   ) = _FIXED.unpack_from(payload)
  at = _FIXED.size
  texts = []
  for _ in range(1 + n_notes):
    (n,) = _LENGTH.unpack_from(payload, at)
    texts.append(bytes(payload[at + 4:at + 4 + n]).decode("utf-8", "surrogatepass"))
    at += 4 + n
  end = at + n_arrays * _ARRAY.size
  arrays = []
  places = zip([buffers] * n_arrays, offsets) if offsets is not None else zip(
      buffers, [0] * n_arrays)
  for (code, ndim, *shape), (buffer, offset) in zip(_ARRAY.iter_unpack(payload[at:end]), places):
    dtype = _DTYPES.get(code)
    if dtype is None:
      dtype = _DTYPES[code] = np.dtype(code.rstrip(b"\0").decode())
    arrays.append(np.ndarray(shape[:ndim], dtype, buffer, offset))
  fields = [arrays[i] for i in struct.unpack_from(f"<{len(_FIELDS) + n_vae}I", payload, end)]
  layout = dict(zip(_FIELDS, fields))
  layout["vae_images"] = tuple(fields[len(_FIELDS):])
  key = _made(SampleKey, {"group": group, "index": index, "epoch": epoch, "record": texts[0]})
  return _made(PreparedSample, {
      "key": key, "packed_size": packed_size, "layout": _made(SampleLayout, layout),
      "image_tokens": image_tokens, "notes": tuple(Note(t) for t in texts[1:]),
      "usage": _made(Usage, dict(zip(_USAGE, usage)))})  # (its cached_property's value)
