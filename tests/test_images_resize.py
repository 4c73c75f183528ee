"""Image decoding, mode handling and the BAGEL resize rule against upstream's goldens."""

import io
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image, ImageFile

from bagel_grain.images import (
    ImageError, ImageTransform, decode_image, decode_resized,
    resize_image, resize_size, to_rgb)
from golden import GOLDEN, array_digest, load_json

CAP = 64_000_000

_SIZES = load_json("resize_sizes.json")
_PIXELS = load_json("resized_pixels.json")
_PIXEL_DIGESTS = load_json("resized_pixels_sha256.json")


def _transforms(doc):
  return {name: ImageTransform(**args) for name, args in doc["transforms"].items()}


def test_resize_sizes_match_every_golden_case():
  transforms = _transforms(_SIZES)
  assert len(_SIZES["cases"]) == 2400
  wrong = []
  for c in _SIZES["cases"]:
    got = resize_size(c["w"], c["h"], transforms[c["transform"]], c["img_num"])
    if got != (c["out_w"], c["out_h"]):
      wrong.append((c, got))
  assert not wrong, f"{len(wrong)} mismatches, first: {wrong[:3]}"


@pytest.mark.parametrize("case", _PIXELS["cases"], ids=lambda c: c["expected_png"])
def test_resized_pixels_match_golden_exactly(case):
  transform = _transforms(_PIXELS)[case["transform"]]
  img = decode_image((GOLDEN / "images" / case["source"]).read_bytes(), max_pixels_decode=CAP)
  got = resize_image(to_rgb(img), transform, case["img_num"])
  want = _PIXEL_DIGESTS[case["expected_png"]]  # upstream's output PNG, pinned by its hash
  assert got.dtype == np.uint8 and got.flags.c_contiguous
  assert got.shape == (case["out_h"], case["out_w"], 3) == tuple(want["shape"])
  assert array_digest(got) == want


def test_pixel_digests_cover_every_case_and_see_one_level_of_one_pixel():
  assert set(_PIXEL_DIGESTS) == {c["expected_png"] for c in _PIXELS["cases"]}
  a = np.zeros((4, 5, 3), np.uint8)
  b = a.copy()
  b[3, 4, 2] = 1
  assert array_digest(a) != array_digest(b)
  assert array_digest(a) != array_digest(a.reshape(5, 4, 3))


def test_decode_resized_equals_the_steps_for_every_target():
  case = _PIXELS["cases"][0]
  transforms = _transforms(_PIXELS)
  data = (GOLDEN / "images" / case["source"]).read_bytes()
  targets = [(t, n) for t in transforms.values() for n in (1, 3)]
  img = decode_image(data, max_pixels_decode=CAP)
  resized = decode_resized(data, targets, max_pixels_decode=CAP)  # one decode, many sizes
  assert len(resized) == len(targets)
  for (transform, n), got in zip(targets, resized):
    np.testing.assert_array_equal(got, resize_image(img, transform, n))


def test_same_size_resize_is_identity():
  t = ImageTransform(max_image_size=64, min_image_size=32, image_stride=16)
  rng = np.random.default_rng(0)
  arr = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
  assert resize_size(64, 48, t) == (64, 48)
  img = Image.fromarray(arr)
  np.testing.assert_array_equal(np.asarray(img.resize((64, 48), Image.BICUBIC)), arr)
  np.testing.assert_array_equal(resize_image(img, t), arr)


# --- modes ---------------------------------------------------------------------------------

def _encode(img, fmt, **kw):
  buf = io.BytesIO()
  img.save(buf, format=fmt, **kw)
  return buf.getvalue()


def _mode_images():
  rng = np.random.default_rng(1)
  grey = rng.integers(0, 256, (20, 30), dtype=np.uint8)
  rgb = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
  p = Image.fromarray(grey).convert("P")
  p_trns = p.copy()
  p_trns.info["transparency"] = 3
  l_trns = Image.fromarray(grey)
  l_trns.info["transparency"] = 7
  rgb_trns = Image.fromarray(rgb)
  rgb_trns.info["transparency"] = tuple(int(v) for v in rgb[0, 0])
  return {
      "1": (Image.fromarray(grey > 128), "PNG"),
      "L": (Image.fromarray(grey), "PNG"),
      "L_trns": (l_trns, "PNG"),
      "P": (p, "PNG"),
      "P_trns": (p_trns, "PNG"),
      "LA": (Image.fromarray(np.stack([grey, grey], -1), mode="LA"), "PNG"),
      "RGB": (Image.fromarray(rgb), "PNG"),
      "RGB_trns": (rgb_trns, "PNG"),
      "RGBA": (Image.fromarray(np.dstack([rgb, grey]), mode="RGBA"), "PNG"),
      "CMYK": (Image.fromarray(rgb).convert("CMYK"), "JPEG"),
      "I;16": (Image.fromarray(grey.astype(np.uint16) * 257), "PNG"),
      "I": (Image.fromarray(grey.astype(np.int32) * 257, mode="I"), "TIFF"),
      "F": (Image.fromarray(grey.astype(np.float32) / 255.0, mode="F"), "TIFF"),
  }


@pytest.mark.parametrize("name", sorted(_mode_images()))
def test_every_mode_decodes_to_rgb(name):
  img, fmt = _mode_images()[name]
  data = _encode(img, fmt)
  out = decode_image(data, max_pixels_decode=CAP)
  assert out.mode == "RGB" and out.size == (30, 20)
  arr = resize_image(out, ImageTransform(max_image_size=64, min_image_size=32, image_stride=16))
  assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3


@pytest.mark.parametrize("name", ["I;16", "I", "F"])
def test_high_bit_depth_greys_are_rescaled_not_clipped(name):
  img, fmt = _mode_images()[name]
  grey = np.asarray(_mode_images()["L"][0])
  out = np.asarray(decode_image(_encode(img, fmt), max_pixels_decode=CAP))
  # The test image spans 0..255 in 8 bit, so each mode's rescale recovers it.
  assert np.abs(out[..., 0].astype(int) - grey).max() <= 1
  assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()


def test_rgba_is_composited_on_white():
  arr = np.array([[[10, 20, 30, 0], [10, 20, 30, 255], [200, 100, 0, 128]]], dtype=np.uint8)
  out = np.asarray(to_rgb(Image.fromarray(arr, mode="RGBA")))
  assert out[0, 0].tolist() == [255, 255, 255]
  assert out[0, 1].tolist() == [10, 20, 30]
  assert all(abs(a - b) <= 1 for a, b in zip(out[0, 2].tolist(), [227, 177, 127]))


def test_la_alpha_is_dropped_not_composited():
  arr = np.array([[[100, 0], [50, 255]]], dtype=np.uint8)
  out = np.asarray(to_rgb(Image.fromarray(arr, mode="LA")))
  assert out.tolist() == [[[100, 100, 100], [50, 50, 50]]]


def test_palette_transparency_key_becomes_white():
  img = Image.fromarray(np.array([[3, 4]], dtype=np.uint8)).convert("P")
  img.putpalette([0, 0, 0] * 3 + [255, 0, 0] + [0, 255, 0] + [0] * 3 * 251)
  img.info["transparency"] = 3
  out = np.asarray(decode_image(_encode(img, "PNG"), max_pixels_decode=CAP))
  assert out.tolist() == [[[255, 255, 255], [0, 255, 0]]]


# --- bad input -----------------------------------------------------------------------------

def _png_chunk(tag, body):
  return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))


def _png_header_only(w, h):
  """A PNG that declares w x h RGB pixels but carries one tiny IDAT."""
  ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
  return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
          + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 4)) + _png_chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [100_000, 9_000, 3_000])
def test_too_many_pixels_refused_from_header_without_decoding(side):
  limit_before = Image.MAX_IMAGE_PIXELS
  truncated_before = ImageFile.LOAD_TRUNCATED_IMAGES
  filters_before = list(warnings.filters)
  start = time.perf_counter()
  with pytest.raises(ImageError) as e:
    decode_image(_png_header_only(side, side), max_pixels_decode=1_000_000)
  assert e.value.reason == "too_many_pixels"
  assert time.perf_counter() - start < 1.0
  assert Image.MAX_IMAGE_PIXELS == limit_before
  assert ImageFile.LOAD_TRUNCATED_IMAGES == truncated_before
  assert warnings.filters == filters_before


def test_pillow_bomb_warning_counts_as_too_many_pixels():
  # Over Pillow's MAX_IMAGE_PIXELS (warning zone) but under our cap: still refused.
  side = int((Image.MAX_IMAGE_PIXELS * 1.5) ** 0.5)
  with pytest.raises(ImageError) as e:
    decode_image(_png_header_only(side, side), max_pixels_decode=10 * side * side)
  assert e.value.reason == "too_many_pixels"


def test_header_under_the_cap_is_decoded():
  # Same tiny IDAT, small header: decoding is attempted and fails as bad data instead.
  with pytest.raises(ImageError) as e:
    decode_image(_png_header_only(100, 100), max_pixels_decode=1_000_000)
  assert e.value.reason in ("bad_image", "truncated_image")


def test_truncated_jpeg():
  data = (GOLDEN / "images" / "t2i_000.src").read_bytes()
  for frac in (0.9, 0.5, 0.1):
    with pytest.raises(ImageError) as e:
      decode_image(data[:int(len(data) * frac)], max_pixels_decode=CAP)
    assert e.value.reason == "truncated_image"


@pytest.mark.parametrize("data", [b"", b"garbage" * 20, bytes(range(256)), b"\xff\xd8\xff" + b"\x00" * 40])
def test_garbage_is_bad_image(data):
  with pytest.raises(ImageError) as e:
    decode_image(data, max_pixels_decode=CAP)
  assert e.value.reason == "bad_image"


# --- property ------------------------------------------------------------------------------

@st.composite
def _transform_params(draw):
  stride = draw(st.sampled_from([8, 14, 16, 28, 32]))
  min_size = draw(st.integers(stride, 1024))
  max_size = draw(st.integers(min_size, 2048))
  max_pixels = draw(st.integers(stride * stride, 4_000_000))
  return ImageTransform(max_size, min_size, stride, max_pixels)


@settings(max_examples=500, deadline=None)
@given(w=st.integers(1, 20_000), h=st.integers(1, 20_000), t=_transform_params(),
       img_num=st.integers(1, 16))
def test_resize_size_is_stride_aligned(w, h, t, img_num):
  out_w, out_h = resize_size(w, h, t, img_num)
  for v in (out_w, out_h):
    assert v >= t.image_stride and v % t.image_stride == 0
  # The long edge overshoots max_image_size by less than a stride (docs/packed_row.md, symbol S).
  assert max(out_w, out_h) < t.max_image_size + t.image_stride


def test_jpeg_draft_fast_path_stays_within_its_documented_difference():
  """README: draft decoding differs by at most 3.0 mean / 80 max (uint8) on the goldens."""
  cases = load_json("resized_pixels.json")
  transforms = {k: ImageTransform(**v) for k, v in cases["transforms"].items()}
  engaged = 0
  for case in cases["cases"]:
    data = (GOLDEN / "images" / case["source"]).read_bytes()
    target = [(transforms[case["transform"]], case["img_num"])]
    exact = decode_resized(data, target, max_pixels_decode=CAP)[0]
    fast = decode_resized(data, target, max_pixels_decode=CAP, jpeg_draft=True)[0]
    assert fast.shape == exact.shape
    diff = np.abs(exact.astype(int) - fast.astype(int))
    engaged += bool(diff.any())
    assert diff.mean() <= 3.0 and diff.max() <= 80, case
  assert engaged >= 3  # the fast path does engage on downscaled JPEGs
