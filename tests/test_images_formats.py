"""Which image files are opened at all, and what is refused before decoding (docs/images.md)."""

import io
import subprocess

import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image, ImageFile

from bagel_grain.images import (
    ALLOWED_FORMATS, MAX_JPEG_SCANS, ImageError, count_jpeg_scans, decode_image,
    decode_resized, image_size)
from hostile_images import (eps_bytes, ico_with_png, install_fake_gs, png_bytes,
                            progressive_jpeg, repeat_last_scan, spy_decoders)

CAP = 10**7


@pytest.fixture
def decoder_calls(monkeypatch):
  return spy_decoders(monkeypatch)


@pytest.mark.parametrize("fmt,mode", [("JPEG", "RGB"), ("PNG", "RGBA"), ("WEBP", "RGB"),
                                      ("GIF", "P"), ("BMP", "RGB"), ("TIFF", "RGB")])
def test_every_allowed_format_decodes(fmt, mode):
  assert fmt in ALLOWED_FORMATS
  out = io.BytesIO()
  Image.new(mode, (40, 30), 7).save(out, fmt)
  assert image_size(out.getvalue(), max_pixels_decode=CAP) == (40, 30)
  assert decode_image(out.getvalue(), max_pixels_decode=CAP).size == (40, 30)


def test_an_eps_file_never_starts_ghostscript(tmp_path, monkeypatch):
  log = install_fake_gs(tmp_path, monkeypatch)
  for call in (lambda d: decode_image(d, max_pixels_decode=CAP),
               lambda d: image_size(d, max_pixels_decode=CAP)):
    with pytest.raises(ImageError) as e:
      call(eps_bytes())
    assert e.value.reason == "bad_image" and "EPS is not an allowed image format" in str(e.value)
  assert not log.exists()


def test_an_ico_is_refused_before_its_png_decodes(decoder_calls):
  ico = ico_with_png(png_bytes((2000, 2000)))  # 4 Mpx behind a 16x16 directory entry
  with pytest.raises(ImageError) as e:
    decode_resized(ico, [], max_pixels_decode=10**6)
  assert e.value.reason == "bad_image" and "ICO" in str(e.value)
  assert decoder_calls == []


def test_any_error_inside_a_decoder_is_a_drop(monkeypatch):
  def fails(self):
    raise subprocess.CalledProcessError(1, ["some", "helper"])

  monkeypatch.setattr(ImageFile.ImageFile, "load", fails)
  with pytest.raises(ImageError) as e:
    decode_image(png_bytes((8, 8)), max_pixels_decode=CAP)
  assert e.value.reason == "bad_image" and "CalledProcessError" in str(e.value)


@pytest.mark.parametrize("mode,scans", [("RGB", 10), ("L", 6)])  # libjpeg's progressive script
def test_scans_of_pillow_progressive_jpegs(mode, scans):
  out = io.BytesIO()
  Image.new(mode, (64, 48), 90).save(out, "JPEG", progressive=True)
  assert count_jpeg_scans(out.getvalue()) == scans
  out = io.BytesIO()
  Image.new(mode, (64, 48), 90).save(out, "JPEG", restart_marker_blocks=1)  # RSTn inside
  assert count_jpeg_scans(out.getvalue()) == 1


def test_a_scan_inside_an_app_segment_is_not_counted():
  thumbnail = repeat_last_scan(progressive_jpeg((16, 16)), 400)  # 410 scans, in an APP1
  jpeg = progressive_jpeg((32, 32))
  app1 = b"\xff\xe1" + (len(thumbnail) + 2).to_bytes(2, "big") + thumbnail
  assert len(thumbnail) + 2 < 1 << 16
  assert count_jpeg_scans(jpeg[:2] + app1 + jpeg[2:]) == 10


@settings(max_examples=20, deadline=None)
@given(extra=st.integers(0, 2 * MAX_JPEG_SCANS))
def test_a_jpeg_past_the_scan_limit_is_dropped_undecoded(extra):
  bomb = repeat_last_scan(progressive_jpeg((24, 16)), extra)
  calls = []
  real = Image._getdecoder
  Image._getdecoder = lambda *a: calls.append(a[1]) or real(*a)
  try:
    if 10 + extra <= MAX_JPEG_SCANS:
      assert decode_image(bomb, max_pixels_decode=CAP).size == (24, 16)
      assert calls == ["jpeg"]
    else:
      with pytest.raises(ImageError) as e:
        decode_image(bomb, max_pixels_decode=CAP)
      assert e.value.reason == "too_many_jpeg_scans" and calls == []
  finally:
    Image._getdecoder = real


def test_scans_past_the_end_of_the_first_image_are_not_counted():
  first = progressive_jpeg((16, 16))
  assert count_jpeg_scans(first + repeat_last_scan(first, 300)) == 10


def test_truncated_and_garbage_marker_streams_end():
  jpeg = repeat_last_scan(progressive_jpeg((16, 16)), 3)
  for cut in range(0, len(jpeg), 7):
    assert 0 <= count_jpeg_scans(jpeg[:cut]) <= 13
  assert count_jpeg_scans(b"\xff\xd8" + bytes(range(256)) * 4) == 0


def test_a_jpeg_compressed_tiff_is_refused(decoder_calls):
  out = io.BytesIO()
  Image.new("RGB", (32, 32), (100, 90, 80)).save(out, "TIFF", compression="jpeg")
  with pytest.raises(ImageError) as e:
    decode_image(out.getvalue(), max_pixels_decode=CAP)
  assert e.value.reason == "bad_image" and "JPEG-compressed TIFF" in str(e.value)
  assert decoder_calls == []


def test_a_png_cut_anywhere_is_a_truncated_image():
  # As a short read of an object gives it: cut inside the header chunks, Pillow only says
  # it "cannot identify" the file, which was counted as bad_image.
  out = io.BytesIO()
  Image.new("RGB", (24, 16), (10, 200, 30)).save(out, "PNG")
  data = out.getvalue()
  idat = data.index(b"IDAT") - 4
  for cut in [9, 20, 33, 40, idat, idat + 10, len(data) // 2]:
    with pytest.raises(ImageError) as e:
      decode_image(data[:cut], max_pixels_decode=CAP)
    assert e.value.reason == "truncated_image", (cut, str(e.value))
  with pytest.raises(ImageError) as e:  # not a PNG at all: still bad_image
    decode_image(b"\x89PNX" + data[4:40], max_pixels_decode=CAP)
  assert e.value.reason == "bad_image"
