"""Image decoding, mode handling and BAGEL's resize rule (docs/design.md, sections 3 and 8)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import struct
import warnings
from typing import Sequence

import numpy as np
from PIL import Image, ImageFile

from bagel_grain.drops import IMAGE_REASONS, Drop, DropReason

DEFAULT_MAX_PIXELS = 14 * 14 * 9 * 1024
DEFAULT_MAX_IMAGE_BYTES = 128 << 20  # an image file larger than this is not read

# The only formats an image may be opened as (docs/images.md): those image datasets
# hold, whose plugins read a header only when opening and never start a process.
# EPS (Ghostscript), ICO/CUR (decodes its PNG while opening) and every other plugin
# are refused before any byte of them is interpreted. MPO (a phone's multi-picture
# JPEG) comes through the JPEG plugin.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# A progressive JPEG decodes every scan over the whole image: its cost is scans x pixels.
# Real encoders write 1 (baseline) to about 10-20 scans (libjpeg's progressive script: 10
# for colour); nvImageCodec refuses more than 256 by default for the same attack
# (libjpeg-turbo's `-maxscans` / TJPARAM_SCANLIMIT): at most 256 full passes.
MAX_JPEG_SCANS = 256
_TIFF_JPEG = ("jpeg", "tiff_jpeg")  # JPEG inside TIFF strips: libtiff decodes, scans unseen


class ImageError(Drop):
  """An image that cannot become pixels: a Drop with one of the image reasons."""

  def __init__(self, reason: DropReason, message: str = ""):
    if reason not in IMAGE_REASONS:
      raise ValueError(f"unknown ImageError reason {reason!r}")
    super().__init__(reason, message)


@dataclasses.dataclass(frozen=True)
class ImageTransform:
  """Upstream's `image_transform_args`: size bounds, stride and pixel budget."""

  max_image_size: int
  min_image_size: int
  image_stride: int
  max_pixels: int = DEFAULT_MAX_PIXELS


def _apply_scale(w: int, h: int, scale: float, stride: int) -> tuple[int, int]:
  """Scale, then snap each edge to the nearest multiple of stride (at least one stride)."""
  def snap(v: float) -> int:
    return max(stride, int(round(round(v) / stride) * stride))
  return snap(w * scale), snap(h * scale)


def resize_size(w: int, h: int, transform: ImageTransform, img_num: int = 1) -> tuple[int, int]:
  """Output (width, height) of upstream's MaxLongEdgeMinShortEdgeResize.

  Steps, in upstream's order: bound the long edge by max and the short edge by min
  (min wins), snap to the stride; if the area is over `max_pixels / img_num`,
  rescale by the *area* ratio (upstream's rule, not its square root, so this
  shrinks much more than needed); if the long edge is still over max, rescale
  once more. Each later step works on the already snapped size.
  """
  t = transform
  scale = max(min(t.max_image_size / max(w, h), 1.0), t.min_image_size / min(w, h))
  w, h = _apply_scale(w, h, scale, t.image_stride)
  budget = t.max_pixels / img_num
  if w * h > budget:
    w, h = _apply_scale(w, h, budget / (w * h), t.image_stride)
  if max(w, h) > t.max_image_size:
    w, h = _apply_scale(w, h, t.max_image_size / max(w, h), t.image_stride)
  return w, h


def _is_high_bit(mode: str) -> bool:
  return mode in ("I", "F") or mode.startswith("I;16")


_STRIP_PIXELS = 1 << 18  # conversions run on strips of about this many pixels


def _strips(img: Image.Image):
  """(top, strip image) over the rows of `img`, each strip about `_STRIP_PIXELS` pixels."""
  rows = max(1, _STRIP_PIXELS // max(1, img.width))
  for top in range(0, img.height, rows):
    yield top, img.crop((0, top, img.width, min(top + rows, img.height)))


def _float_range(img: Image.Image) -> tuple[float, float]:
  """Min and max of the finite values of an F image, strip by strip."""
  lo, hi = np.inf, -np.inf
  for _, strip in _strips(img):
    a = np.asarray(strip)
    finite = a[np.isfinite(a)]
    if finite.size:
      lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
  return (lo, hi) if lo <= hi else (0.0, 0.0)


def _to_8bit(img: Image.Image, value_range: tuple[float, float] | None) -> Image.Image:
  """Map 16-bit, 32-bit and float grey images to 8 bit (L, or RGBA when keyed).

  Pillow's convert("RGB") clips I, I;16 and F values to 0..255 (a 16-bit photo
  turns almost white, a 0..1 float one black) instead of rescaling. Integer modes
  are read as 16-bit samples (what 16-bit PNG / TIFF decode to) and scaled by
  1/257, rounded to nearest (`(v + 128) // 257`, exact integer arithmetic); F has
  no fixed range, so the image's `value_range` (its finite min..max) is stretched
  to 0..255. A transparency key becomes alpha so to_rgb can composite it.
  Upstream would let Pillow clip; no golden covers these modes.
  """
  a = np.asarray(img)
  if img.mode == "F":
    lo, hi = value_range
    x = a.astype(np.float64)
    x = np.nan_to_num((x - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(x))
    grey = np.clip(np.rint(x), 0, 255).astype(np.uint8)
  else:
    wide = a.astype(np.int64 if img.mode == "I" else np.int32)  # room for the + 128
    wide += 128
    wide //= 257
    grey = np.clip(wide, 0, 255).astype(np.uint8)
  key = img.info.get("transparency")
  if key is None or isinstance(key, (bytes, tuple)):
    return Image.fromarray(grey, mode="L")
  alpha = np.where(a == key, 0, 255).astype(np.uint8)
  return Image.fromarray(np.stack([grey, grey, grey, alpha], axis=-1), mode="RGBA")


def _piece_to_rgb(img: Image.Image, value_range: tuple[float, float] | None) -> Image.Image:
  if _is_high_bit(img.mode):
    img = _to_8bit(img, value_range)
  if img.mode == "RGBA" or "transparency" in img.info:
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
  return img.convert("RGB")


def _by_strips(img: Image.Image, mode: str, convert) -> Image.Image:
  """`convert` (a per-pixel conversion to `mode`) applied strip by strip into one new image.

  Every step is per pixel, so the result is the same as converting the whole image;
  the memory is the result plus one strip's temporaries, never whole-image copies.
  """
  if img.width * img.height <= _STRIP_PIXELS:
    return convert(img)
  out = Image.new(mode, img.size)
  for top, strip in _strips(img):
    out.paste(convert(strip), (0, top))
  return out


def to_rgb(img: Image.Image) -> Image.Image:
  """Upstream's pil_img2rgb: composite RGBA / transparency-keyed images on white, else convert.

  LA keeps upstream's behaviour: alpha is dropped, not composited. High bit depth
  grey modes are first scaled to 8 bit (see _to_8bit). An RGB image is returned
  as it is; any other is converted strip by strip (see _by_strips).
  """
  if img.mode == "RGB" and "transparency" not in img.info:
    return img
  value_range = _float_range(img) if img.mode == "F" else None
  return _by_strips(img, "RGB", lambda piece: _piece_to_rgb(piece, value_range))


def _grey_or_rgb(img: Image.Image) -> Image.Image:
  """`to_rgb(img)`, or its single grey channel (L) when its three channels would be equal.

  A grey image stays one byte per pixel until it is resized; resizing L and then
  replicating the channel gives the same pixels as resizing the replicated RGB
  (Pillow resamples each channel alike).
  """
  grey = img.mode in ("1", "L", "LA") or _is_high_bit(img.mode)
  if not grey or "transparency" in img.info:
    return to_rgb(img)
  if img.mode == "L":
    return img
  value_range = _float_range(img) if img.mode == "F" else None
  return _by_strips(img, "L", lambda piece: (_to_8bit(piece, value_range)
                                             if _is_high_bit(piece.mode) else piece.convert("L")))


def enable_truncated_images() -> None:
  """Process-wide opt-in to decode truncated files; call once at build time, never at import."""
  ImageFile.LOAD_TRUNCATED_IMAGES = True


@contextlib.contextmanager
def _image_errors():
  """Maps everything Pillow raises on bad input to ImageError with its stats reason."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", Image.DecompressionBombWarning)
      yield
  except ImageError:
    raise
  except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
    raise ImageError(DropReason.TOO_MANY_PIXELS, str(e)) from e
  except OSError as e:
    msg = str(e)
    if "truncated" in msg.lower():  # Pillow: "image file is truncated", "Truncated File Read"
      raise ImageError(DropReason.TRUNCATED_IMAGE, msg) from e
    raise ImageError(DropReason.BAD_IMAGE, msg) from e
  except Exception as e:  # pylint: disable=broad-except
    # Any other failure inside a decoder is this record's, not the stream's.
    raise ImageError(DropReason.BAD_IMAGE, f"{type(e).__name__}: {e}") from e


def _refused_format(data: bytes) -> str:
  """The name of a known but refused format `data` starts like, for the drop's detail."""
  Image.init()
  prefix = data[:16]
  for name, (_, accept) in Image.OPEN.items():
    if name not in ALLOWED_FORMATS and accept is not None:
      try:
        if accept(prefix) is True:
          return name
      except Exception:  # pylint: disable=broad-except
        continue
  return ""


# A marker inside entropy-coded data: 0xFF then neither a stuffed 0x00, a restart marker
# (RST0-7 stay inside a scan) nor a fill byte (0xFF, the next one starts the marker).
_JPEG_NEXT_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")
_JPEG_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no segment


def count_jpeg_scans(data: bytes, limit: int = MAX_JPEG_SCANS) -> int:
  """Start-of-scan markers of the first image of a JPEG stream, as libjpeg meets them.

  Walks the segments by their lengths (an SOS inside an APPn thumbnail is not
  counted), and over each scan's entropy-coded data to the next marker; stops at
  EOI, at the end of the data, or once past `limit`. Bytes between segments are
  skipped to the next 0xFF, as libjpeg does. No pixel is decoded: one pass over
  the bytes, most of it a C regex search.
  """
  scans, pos, end = 0, 2, len(data)  # after SOI
  while pos + 1 < end and scans <= limit:
    if data[pos] != 0xFF:
      pos = data.find(b"\xff", pos)
      if pos < 0:
        break
      continue
    marker = data[pos + 1]
    if marker == 0xFF or marker in _JPEG_NO_LENGTH or marker == 0x00:
      pos += 1 if marker == 0xFF else 2
      continue
    if marker == 0xD9:  # EOI
      break
    if pos + 4 > end:
      break
    segment_end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    if marker != 0xDA:
      pos = segment_end
      continue
    scans += 1
    found = _JPEG_NEXT_MARKER.search(data, segment_end)
    if found is None:
      break
    pos = found.start()
  return scans


def _check_decode_cost(img: Image.Image, data: bytes) -> None:
  """Refuses, before any decoding, what would cost more than its pixels: a JPEG of more
  than MAX_JPEG_SCANS scans, a TIFF whose strips are JPEG (their scans are not counted)."""
  if img.format in ("JPEG", "MPO"):
    scans = count_jpeg_scans(data)
    if scans > MAX_JPEG_SCANS:
      raise ImageError(DropReason.TOO_MANY_JPEG_SCANS,
                       f"more than {MAX_JPEG_SCANS} scans (each decodes the whole image)")
  elif img.format == "TIFF" and img.info.get("compression") in _TIFF_JPEG:
    raise ImageError(DropReason.BAD_IMAGE, "a JPEG-compressed TIFF is not decoded: its JPEG "
                     "scans cannot be counted before decoding; store it as JPEG or PNG")


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_cut_in_header(data: bytes) -> bool:
  """A PNG whose chunks run past the end of the data before its first image data (IDAT):
  a file cut short (Pillow says only that it cannot identify it)."""
  if not data.startswith(_PNG_SIGNATURE):
    return False
  at = len(_PNG_SIGNATURE)
  while at + 8 <= len(data):
    length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
    if kind == b"IDAT":
      return False
    at += 12 + length
  return True


def _open_checked(data: bytes, max_pixels_decode: int) -> Image.Image:
  """Opens lazily (header only) as one of ALLOWED_FORMATS, and refuses a header over the
  pixel cap, or a decode that would cost more than its pixels, before decoding."""
  try:
    img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
  except Image.UnidentifiedImageError as e:
    refused = _refused_format(data)
    if refused:
      raise ImageError(DropReason.BAD_IMAGE, f"{refused} is not an allowed image format "
                       f"({', '.join(ALLOWED_FORMATS)}); convert it") from e
    if _png_cut_in_header(data):
      raise ImageError(DropReason.TRUNCATED_IMAGE, f"a PNG that ends after {len(data)} bytes, "
                       "inside its header chunks") from e
    raise
  w, h = img.size
  if w * h > max_pixels_decode:
    raise ImageError(DropReason.TOO_MANY_PIXELS, f"{w}x{h} > {max_pixels_decode} pixels")
  _check_decode_cost(img, data)
  return img


def image_size(data: bytes, *, max_pixels_decode: int) -> tuple[int, int]:
  """(width, height) from the header, with every check `decode_image` makes before
  decoding (the same ImageError); no pixel is decoded."""
  with _image_errors():
    return _open_checked(data, max_pixels_decode).size


def decode_image(data: bytes, *, max_pixels_decode: int) -> Image.Image:
  """Decode encoded bytes to an RGB image, checking the header size before decoding.

  Raises ImageError with reason "too_many_pixels" (header over the cap, or a Pillow
  decompression-bomb signal, so the effective cap is also bounded by Pillow's
  `Image.MAX_IMAGE_PIXELS`), "truncated_image" or "bad_image". Pillow's globals
  are left untouched (the local warnings.catch_warnings is itself process-wide
  before Python 3.14; it only escalates DecompressionBombWarning). A truncated
  file decodes only under the process-wide `enable_truncated_images()` switch,
  which the pipeline sets once at build time. EXIF orientation is not applied
  (upstream does not apply it).
  """
  with _image_errors():
    img = _open_checked(data, max_pixels_decode)
    img.load()
    return to_rgb(img)


def decode_resized(data: bytes, targets: Sequence[tuple[ImageTransform, int]], *,
                   max_pixels_decode: int, jpeg_draft: bool = False) -> list[np.ndarray]:
  """Decodes once and resizes to every `(transform, img_num)` target (uint8 HWC each).

  `jpeg_draft` (opt-in, off by default: it changes pixels slightly) lets libjpeg
  decode a JPEG at 1/2, 1/4 or 1/8 scale when every target is at least that much
  smaller, then resizes from there; sizes are still computed from the full image.
  """
  with _image_errors():
    img = _open_checked(data, max_pixels_decode)
    sizes = [resize_size(img.width, img.height, t, n) for t, n in targets]
    if jpeg_draft and img.format == "JPEG":
      img.draft(None, (max(w for w, _ in sizes), max(h for _, h in sizes)))
    img.load()
    pixels = _grey_or_rgb(img)
  del img  # the decoded image, when converted, is not kept while resizing
  return [resize_to(pixels, size) for size in sizes]


def resize_to(img: Image.Image, size: tuple[int, int]) -> np.ndarray:
  """PIL bicubic resize of an RGB (or grey L) image to `size` (w, h); uint8 HWC RGB array."""
  if size != img.size:  # Pillow's same-size resize is a plain copy: skipping is identical.
    img = img.resize(size, Image.BICUBIC)
  if img.mode != "RGB":
    img = img.convert("RGB")
  return np.ascontiguousarray(np.asarray(img, dtype=np.uint8))


def resize_image(img: Image.Image, transform: ImageTransform, img_num: int = 1) -> np.ndarray:
  """Resize an RGB image by the BAGEL rule with PIL bicubic; uint8 HWC contiguous array."""
  if img.mode != "RGB":
    img = to_rgb(img)
  return resize_to(img, resize_size(img.width, img.height, transform, img_num))
