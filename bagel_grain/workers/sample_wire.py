"""A prepared sample's bytes between a worker and the main process, without pickle.

Unpickling a `PreparedSample` (three dataclasses, about twenty numpy arrays, each rebuilt
by numpy's reducer) was the largest part of the main process's pump. Here its metadata is
one struct-packed header and its arrays are raw buffers (placed in the worker's slab or
sent over its socket, as pickle's out-of-band buffers are); the main process rebuilds
each array as a view of its buffer. Arrays shared between fields (an edit chain's VAE
views of one image) stay shared, as pickle keeps them. Anything else (a dropped record,
an error, another pipeline's element) goes as a pickle: `encode` returns None for it.

The one-dimensional arrays (the per-token and per-split fields, a dozen a sample) go
joined, one buffer per dtype, and come back as slices of one array per dtype: building
an array over a buffer costs about five times as much as slicing one, and the pump
builds every sample's.

Header: magic, group, index, epoch, packed_size, image_tokens, the sample's row usage
(`PreparedSample.usage`, worked out in the worker: the packer asks for it at once, and its
six numbers cost less to read than to work out again), the counts of VAE images, distinct
arrays, notes and joined buffers; then the record id and each note (length-prefixed
UTF-8), each joined buffer's dtype and length, each distinct array's dtype, shape,
joined buffer (-1: a buffer of its own, in order after the joined ones) and first
element there, and for each field the distinct array it is.
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

MAGIC = b"BGS3"  # a pickle starts with b"\x80"
_FIXED = struct.Struct("<4sqqqqqqqqqqqIIII")
_LENGTH = struct.Struct("<I")
_MAX_DIMS = 4
_ARRAY = struct.Struct(f"<4sB{_MAX_DIMS}qiq")  # dtype.str, ndim, shape (padded), joined, first
_JOINED = struct.Struct("<4sq")  # dtype.str, length
_FIELDS = tuple(f.name for f in dataclasses.fields(SampleLayout) if f.name != "vae_images")


class _Dtypes(dict):
  """Each dtype by its padded `dtype.str`, made on first use (a lookup after that)."""

  def __missing__(self, code: bytes) -> np.dtype:
    dtype = self[code] = np.dtype(code.rstrip(b"\0").decode())
    return dtype


_DTYPES = _Dtypes()
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
  joined: dict[str, list[np.ndarray]] = {}  # per dtype, its one-dimensional arrays
  lengths: dict[str, int] = {}
  places, own = [], []
  for array in arrays:
    if id(array) in distinct:
      continue
    if (type(array) is not np.ndarray or not array.flags.c_contiguous
        or array.dtype.hasobject or array.ndim > _MAX_DIMS or len(array.dtype.str) > 4):
      return None
    distinct[id(array)] = len(places)
    code = array.dtype.str
    if array.ndim == 1:
      place = (list(joined).index(code) if code in joined else len(joined), lengths.get(code, 0))
      joined.setdefault(code, []).append(array)
      lengths[code] = place[1] + len(array)
    else:
      place = (-1, 0)
      own.append(array)
    places.append((array, place))
  buffers = [pickle.PickleBuffer(np.concatenate(parts)) for parts in joined.values()]
  buffers += [pickle.PickleBuffer(array) for array in own]
  parts = [_JOINED.pack(code.encode(), lengths[code]) for code in joined]
  for array, place in places:
    shape = array.shape + (0,) * (_MAX_DIMS - array.ndim)
    parts.append(_ARRAY.pack(array.dtype.str.encode(), array.ndim, *shape, *place))
  usage = value.usage
  header = [_FIXED.pack(MAGIC, *scalars, *(getattr(usage, name) for name in _USAGE),
                        len(layout.vae_images), len(places), len(value.notes), len(joined)),
            _text(key.record)]
  header += [_text(note.value) for note in value.notes]
  header += parts
  header.append(struct.pack(f"<{len(arrays)}I", *(distinct[id(a)] for a in arrays)))
  return b"".join(header), buffers


def is_sample(payload: bytes) -> bool:
  return payload[:4] == MAGIC


def _text_at(payload: bytes, at: int) -> tuple[str, int]:
  (n,) = _LENGTH.unpack_from(payload, at)
  return bytes(payload[at + 4:at + 4 + n]).decode("utf-8", "surrogatepass"), at + 4 + n


def decode(payload: bytes, buffers: Sequence, offsets: Sequence[int] | None = None
           ) -> PreparedSample:
  """The sample `encode` described; its arrays are read-only views of `buffers`
  (numpy arrays of bytes, or bytes), or with `offsets`, of the one array of bytes
  `buffers` at those offsets (a slab's region, `MainSlab.region`: no view per buffer).
  Its dataclasses are made as unpickling makes them (without their `__init__`)."""
  (_, group, index, epoch, packed_size, image_tokens, *usage, n_vae, n_arrays, n_notes,
   n_joined) = _FIXED.unpack_from(payload)
  record, at = _text_at(payload, _FIXED.size)
  notes = []
  for _ in range(n_notes):
    note, at = _text_at(payload, at)
    notes.append(Note(note))
  if offsets is None:  # each buffer at offset 0 of its own
    buffers, offsets = list(buffers), [0] * len(buffers)
  else:
    buffers = [buffers] * len(offsets)
  ndarray, dtypes = np.ndarray, _DTYPES
  bases = [ndarray((length,), dtypes[code], buffer, offset)  # one per joined buffer
           for (code, length), buffer, offset in zip(
               _JOINED.iter_unpack(payload[at:at + n_joined * _JOINED.size]), buffers, offsets)]
  at += n_joined * _JOINED.size
  own = n_joined
  arrays = []
  append = arrays.append
  for code, ndim, d0, d1, d2, d3, joined, first in _ARRAY.iter_unpack(
      payload[at:at + n_arrays * _ARRAY.size]):
    if joined >= 0:
      append(bases[joined][first:first + d0])
    else:
      append(ndarray((d0, d1, d2, d3)[:ndim], dtypes[code], buffers[own], offsets[own]))
      own += 1
  at += n_arrays * _ARRAY.size
  fields = [arrays[i] for i in struct.unpack_from(f"<{len(_FIELDS) + n_vae}I", payload, at)]
  layout = object.__new__(SampleLayout)
  layout.__dict__.update(zip(_FIELDS, fields))
  layout.__dict__["vae_images"] = tuple(fields[len(_FIELDS):])
  key = object.__new__(SampleKey)
  key.__dict__.update(group=group, index=index, epoch=epoch, record=record)
  usage_ = object.__new__(Usage)
  usage_.__dict__.update(zip(_USAGE, usage))
  sample = object.__new__(PreparedSample)
  sample.__dict__.update(key=key, packed_size=packed_size, layout=layout,
                         image_tokens=image_tokens, notes=tuple(notes),
                         usage=usage_)  # (its cached_property's value)
  return sample
