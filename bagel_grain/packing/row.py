"""Fixed-capacity packed rows: capacities, usage accounting, and writing layouts into a row.

A row is written either into an empty row (`empty_row`) or into one that held an
earlier row (a reused batch buffer, `packing.buffers`): `write_row` is told what
the earlier row wrote (its `Extent`) and resets to the fill value only what the
new samples do not overwrite, so both give the same bits.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Sequence

import numpy as np

from bagel_grain.packed_row import ROW_SPEC, PackedRow
from bagel_grain.packing.layout import SampleLayout, concat

@dataclasses.dataclass(frozen=True)
class Usage:
  """What a row (or one sample) occupies, in the units of `Capacities`."""

  tokens: int = 0
  vit_patches: int = 0
  vae_tokens: int = 0
  vae_images: int = 0
  splits: int = 0
  vae_image_size: int = 0  # largest VAE image side: a maximum, not a sum

  @classmethod
  def of(cls, layout: SampleLayout) -> Usage:
    return cls(layout.num_tokens, layout.num_vit_tokens, layout.num_vae_tokens,
               layout.num_vae_images, layout.num_splits, max(layout.max_vae_hw))

  def __add__(self, other: Usage) -> Usage:
    return Usage(self.tokens + other.tokens, self.vit_patches + other.vit_patches,
                 self.vae_tokens + other.vae_tokens, self.vae_images + other.vae_images,
                 self.splits + other.splits,
                 max(self.vae_image_size, other.vae_image_size))


@dataclasses.dataclass(frozen=True)
class Capacities:
  """Static slot counts of a packed row; every batch has these shapes (one compile).

  tokens L (a multiple of 128), vit_patches V, vae_tokens T, vae_images I of
  vae_image_size S x S pixels, splits K; vit_patch_size p sets the ViT patch
  width p*p*3.
  """

  tokens: int
  vit_patches: int
  vae_tokens: int
  vae_images: int
  vae_image_size: int
  splits: int
  vit_patch_size: int = 14

  def __post_init__(self):
    if self.tokens <= 0 or self.tokens % 128:
      raise ValueError(f"tokens capacity must be a positive multiple of 128, got {self.tokens}")
    for f in dataclasses.fields(self):
      if getattr(self, f.name) < 0:
        raise ValueError(f"capacity {f.name} must be >= 0")

  def overflows(self, usage: Usage) -> tuple[str, ...]:
    """Names of the capacities `usage` exceeds (empty when it fits): drop reasons."""
    if (usage.tokens <= self.tokens and usage.vit_patches <= self.vit_patches
        and usage.vae_tokens <= self.vae_tokens and usage.vae_images <= self.vae_images
        and usage.splits <= self.splits and usage.vae_image_size <= self.vae_image_size):
      return ()  # the usual answer, asked twice a sample: without a loop of getattr
    out = []
    for name in ("tokens", "vit_patches", "vae_tokens", "vae_images", "splits",
                 "vae_image_size"):
      if getattr(usage, name) > getattr(self, name):
        out.append(name)
    return tuple(out)

  def fits(self, used: Usage, layout: SampleLayout) -> bool:
    """Whether `layout` can join a row that already holds `used`."""
    return not self.overflows(used + Usage.of(layout))

  def dims(self) -> dict[str, int]:
    """The number behind each shape symbol of `PackedRow`'s fields."""
    return {"L": self.tokens, "K": self.splits, "V": self.vit_patches,
            "P": 3 * self.vit_patch_size**2, "T": self.vae_tokens, "I": self.vae_images,
            "S": self.vae_image_size}

  def row_nbytes(self) -> int:
    """Host bytes of one packed row with these capacities."""
    return sum(a.nbytes for a in empty_row(self).values())


def default_capacities(max_num_tokens: int, vae_max_image_size: int, vae_stride: int,
                       min_vae_tokens_per_image: int, vit_patch_size: int, *,
                       max_vae_images: int = 16) -> Capacities:
  """Capacities derived from the token budget and the image transforms.

  - L = max_num_tokens rounded up to 128.
  - V = T = L: every ViT patch and VAE latent occupies a sequence position, so
    these can never be the binding limit.
  - I = clip(L // (min_vae_tokens_per_image + 2), 1, max_vae_images): as many VAE
    images as the smallest ones (plus their two markers) could fill, capped
    because each slot costs S*S*3 bytes.
  - S = vae_max_image_size rounded up to vae_stride (the resize may overshoot the
    max by less than a stride).
  - K = L // 2: every split holds at least two tokens (text: bos + eos).

  Memory per row, with p = vit_patch_size:
  L*30 (per-token fields) + V*(3p^2 + 12) + T*8 + I*(3*S^2 + 8) + K*5 bytes.
  Example: L = 32768, p = 14, S = 1024, I = 16: 0.94 + 18.75 + 0.25 + 48 + 0.08
  = about 68 MiB (one 1024 x 1024 slot is 3 MiB; the image slots dominate, so
  lower `max_vae_images` or S first when memory is tight).
  """
  tokens = -(-max_num_tokens // 128) * 128
  per_image = max(1, min_vae_tokens_per_image) + 2
  images = int(np.clip(tokens // per_image, 1, max_vae_images))
  size = -(-vae_max_image_size // vae_stride) * vae_stride
  return Capacities(tokens=tokens, vit_patches=tokens, vae_tokens=tokens,
                    vae_images=images, vae_image_size=size, splits=tokens // 2,
                    vit_patch_size=vit_patch_size)


def empty_row(caps: Capacities, batch: tuple[int, ...] = ()) -> PackedRow:
  """A row (or `batch` rows) with no samples: every slot holds its field's fill value."""
  dims = caps.dims()
  row = {}
  for name, field in ROW_SPEC.items():
    shape, fill = (*batch, *field.shape_for(dims)), field.fill_for(dims)
    # zeros: the pages of a large empty batch are only touched where written
    row[name] = np.zeros(shape, field.dtype) if fill == 0 else np.full(shape, fill, field.dtype)
  return row


# Row fields that are a concatenation of the samples' layout fields of the same name,
# their values shifted by the count of what the earlier samples hold.
_SHIFTED_BY = {"split_ids": "splits", "vit_token_index": "tokens",
               "vit_image_ids": "vit_images", "vae_token_index": "tokens"}
# Written by their own functions: pixels go straight into their slots, each image one
# `copy(destination, source)` (by default `destination[...] = source`; a batch whose
# pixels lie in shared memory has the workers copy them, `workers/arena.py`).
PIXELS = ("vit_patches", "vae_images")
Copy = Callable[[np.ndarray, np.ndarray], None]
_CONCATENATED = tuple(name for name in ROW_SPEC if name not in PIXELS
                      and name in SampleLayout.__dataclass_fields__)
# Per concatenated field, the slot dimension its used prefix is counted in, and the count
# of what the earlier samples hold its values are shifted by (None: not shifted), worked
# out once rather than per row (`Field.symbols` splits a string at each call).
_WRITTEN = tuple((name, ROW_SPEC[name].symbols[0], _SHIFTED_BY.get(name))
                 for name in _CONCATENATED)
_FIELDS_OF = operator.attrgetter(*_CONCATENATED)
# Per field `_clear` resets (all but the counts and the VAE images): its slot dimension,
# its fill (None: "L", the row's length) and whether it is a pixel field.
_CLEARED = tuple((name, field.symbols[0],
                  None if isinstance(field.fill, str) else field.fill, name in PIXELS)
                 for name, field in ROW_SPEC.items()
                 if field.symbols and name != "vae_images")


@dataclasses.dataclass(frozen=True)
class Extent:
  """What writing a row's samples touches: the used prefix of each slot dimension (L, K,
  V, T) and the height and width of each VAE image, slot by slot.

  Every field is written over the used prefix of its first dimension; a VAE image
  slot over the image's top-left corner; the rest of the row keeps its fill value.
  """

  used: tuple[tuple[str, int], ...] = (("L", 0), ("K", 0), ("V", 0), ("T", 0))
  vae_hw: tuple[tuple[int, int], ...] = ()

  @classmethod
  def of(cls, layouts: Sequence[SampleLayout]) -> Extent:
    return cls((("L", sum(x.num_tokens for x in layouts)),
                ("K", sum(x.num_splits for x in layouts)),
                ("V", sum(x.num_vit_tokens for x in layouts)),
                ("T", sum(x.num_vae_tokens for x in layouts))),
               tuple(im.shape[:2] for x in layouts for im in x.vae_images))


EMPTY = Extent()  # an empty row's: nothing written


_ZERO = np.uint8(0)  # the pixels' fill (ROW_SPEC)


def _assign(destination: np.ndarray, source: np.ndarray) -> None:
  destination[...] = source


def write_row(row: PackedRow, layouts: Sequence[SampleLayout], *,
              previous: Extent = EMPTY, copy: Copy = _assign) -> Extent:
  """Writes the samples' layouts, in order, into `row` (or a view of a batch row) that holds
  an empty row, or a row that wrote `previous`.

  Each concatenated field is one concatenation straight into its slots (no array in
  between: a row's token fields are about 1 MB), then each sample's part of a shifted
  field is shifted in place. The result is the same, bit for bit, whatever `previous`
  wrote. Each image's pixels go through `copy` (which may leave them to a worker: they
  are in place once it says so). Returns what it wrote: the `previous` of the next row
  written there.
  """
  extent = Extent.of(layouts)
  _clear(row, previous, extent, copy)
  used = dict(extent.used)
  if layouts:
    shifts = _shifts(layouts)
    # Per field, its parts (one attrgetter call per sample, not one getattr per field too).
    for (name, symbol, shifted_by), parts in zip(_WRITTEN, zip(*map(_FIELDS_OF, layouts))):
      out = row[name][:used[symbol]]
      _join(parts, out)
      if shifted_by is not None:
        _shift(out, parts, shifts[shifted_by])
    start = 0
    segments = row["segment_ids"]
    for n, x in enumerate(layouts, 1):
      segments[start:start + x.num_tokens] = n
      start += x.num_tokens
  _write_vit_patches(row, layouts, copy)
  _write_vae_images(row, layouts, copy)
  row["num_tokens"][...] = used["L"]
  row["num_vit_tokens"][...] = used["V"]
  row["num_vae_tokens"][...] = used["T"]
  row["num_samples"][...] = len(layouts)
  return extent


def _join(parts: Sequence[np.ndarray], out: np.ndarray) -> None:
  """`out[...] = concat(parts, out.dtype)`, without the array in between when every part
  has `out`'s dtype (always, for a layout's arrays)."""
  try:
    np.concatenate(parts, out=out, casting="no")
  except TypeError:  # a part of another dtype: converted as `concat` converts it
    out[...] = concat(parts, out.dtype)


def _shift(out: np.ndarray, parts: Sequence[np.ndarray], shifts: Sequence[int]) -> None:
  """Adds to each part's values, in place in `out`, the count of what the samples before
  it hold (the same int32 sums as shifting each part before joining them)."""
  start = 0
  for part, shift in zip(parts, shifts):
    end = start + len(part)
    if shift and end > start:
      out[start:end] += shift
    start = end


def _clear(row: PackedRow, previous: Extent, extent: Extent, copy: Copy) -> None:
  """Resets to its fill value what `previous` wrote and `extent` will not overwrite (the
  pixels through `copy`, as many bytes as an image's)."""
  if previous == EMPTY:
    return
  before, after = dict(previous.used), dict(extent.used)
  before["I"], after["I"] = len(previous.vae_hw), len(extent.vae_hw)
  for name, symbol, fill, pixels in _CLEARED:  # the counts are always written; the
    old, new = before[symbol], after[symbol]  # images below, slot by slot
    if old > new and pixels:
      copy(row[name][new:old], _ZERO)
    elif old > new:
      row[name][new:old] = row["text_ids"].shape[0] if fill is None else fill
  images = row["vae_images"]
  for slot, (old_h, old_w) in enumerate(previous.vae_hw):
    new_h, new_w = extent.vae_hw[slot] if slot < len(extent.vae_hw) else (0, 0)
    if old_h > new_h:  # the old rows below the new image
      copy(images[slot, new_h:old_h, :old_w], _ZERO)
    if old_w > new_w and new_h:  # the old columns right of the new image, above its bottom
      copy(images[slot, :min(old_h, new_h), new_w:old_w], _ZERO)


def _shifts(layouts: Sequence[SampleLayout]) -> dict[str, list[int]]:
  """Per sample: tokens, splits and ViT images of the samples before it."""
  before: dict[str, list[int]] = {"tokens": [], "splits": [], "vit_images": []}
  tokens = splits = images = 0
  for x in layouts:
    before["tokens"].append(tokens)
    before["splits"].append(splits)
    before["vit_images"].append(images)
    tokens += x.num_tokens
    splits += x.num_splits
    if len(x.vit_image_ids):  # (none: a max of 0)
      images += int(x.vit_image_ids.max(initial=0))
  return before


def _write_vit_patches(row: PackedRow, layouts: Sequence[SampleLayout], copy: Copy) -> None:
  start = 0
  for x in layouts:  # straight into the slots: the largest field, copied once
    if len(x.vit_patches):
      copy(row["vit_patches"][start:start + len(x.vit_patches)], x.vit_patches)
    start += len(x.vit_patches)


def _write_vae_images(row: PackedRow, layouts: Sequence[SampleLayout], copy: Copy) -> None:
  images = [im for x in layouts for im in x.vae_images]
  for i, im in enumerate(images):
    copy(row["vae_images"][i, :im.shape[0], :im.shape[1]], im)
  if images:
    row["vae_image_hw"][:len(images)] = [im.shape[:2] for im in images]


class RowBuilder:
  """Accumulates sample layouts for one row, checking the capacities, and writes them.

  It only enforces capacities; which samples go in (token budgets, buffering)
  is the packer's decision.
  """

  def __init__(self, capacities: Capacities):
    self.capacities = capacities
    self.reset()

  def reset(self) -> None:
    """Empties the builder for the next row."""
    self._layouts: list[SampleLayout] = []
    self._usage = Usage()

  @property
  def usage(self) -> Usage:
    return self._usage

  @property
  def used_tokens(self) -> int:
    return self._usage.tokens

  @property
  def num_samples(self) -> int:
    return len(self._layouts)

  def overflows(self, layout: SampleLayout) -> tuple[str, ...]:
    """Capacities that adding `layout` would exceed (empty when it fits)."""
    return self.capacities.overflows(self._usage + Usage.of(layout))

  def fits(self, layout: SampleLayout) -> bool:
    return not self.overflows(layout)

  def add(self, layout: SampleLayout) -> None:
    over = self.overflows(layout)
    if over:
      raise ValueError(f"sample does not fit the row: exceeds {', '.join(over)}")
    self._layouts.append(layout)
    self._usage = self._usage + Usage.of(layout)

  def build(self, out: PackedRow | None = None, b: int = 0) -> PackedRow:
    """The row's arrays; with `out` (an empty batch from `empty_row(caps, (B,))`) written
    in place as row `b`: pixels are copied once, straight into the batch."""
    row = empty_row(self.capacities) if out is None else batch_row(out, b)
    write_row(row, self._layouts)
    return row


def batch_row(batch: PackedRow, b: int) -> PackedRow:
  """Writable views of row `b` of a batch (a (1,)-slice reshaped keeps even the counts
  writable)."""
  return {name: array[b:b + 1].reshape(array.shape[1:]) for name, array in batch.items()}
