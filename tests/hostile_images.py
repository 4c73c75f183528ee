"""Hostile image files for the codec tests (and tools/soak.py): bytes that open as
something else, decode while opening, or cost far more to decode than their pixels."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import numpy as np
from PIL import EpsImagePlugin, Image


def eps_bytes() -> bytes:
  """A small Encapsulated PostScript file: Pillow's EPS plugin renders it with Ghostscript."""
  body = b"newpath 0 0 moveto 10 10 lineto stroke showpage\n"
  return (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\n" + body
          + b"%%EOF\n")


def install_fake_gs(folder: Path, monkeypatch) -> Path:
  """A `gs` first on PATH that records each call in the returned log and fails; Pillow's
  cached answer to "is there a Ghostscript" is reset so it would look again."""
  log = folder / "gs_calls.log"
  gs = folder / "gs"
  gs.write_text(f'#!/bin/sh\necho "gs $*" >> "{log}"\nexit 1\n')
  gs.chmod(0o755)
  monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
  monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
  return log


def png_bytes(size: tuple[int, int], colour=(10, 20, 30)) -> bytes:
  out = io.BytesIO()
  Image.new("RGB", size, colour).save(out, "PNG")
  return out.getvalue()


def ico_with_png(png: bytes, listed: int = 16) -> bytes:
  """An ICO whose one directory entry says `listed` x `listed` but holds `png`."""
  header = struct.pack("<HHH", 0, 1, 1)
  entry = struct.pack("<BBBBHHII", listed % 256, listed % 256, 0, 0, 1, 32, len(png), 6 + 16)
  return header + entry + png


def progressive_jpeg(size: tuple[int, int], seed: int = 0) -> bytes:
  pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, "JPEG", progressive=True, quality=80)
  return out.getvalue()


def repeat_last_scan(jpeg: bytes, extra: int) -> bytes:
  """`jpeg` with its last scan (SOS segment and its data) repeated `extra` more times."""
  last = jpeg.rfind(b"\xff\xda")
  assert jpeg.endswith(b"\xff\xd9") and last > 0
  return jpeg[:last] + jpeg[last:-2] * (extra + 1) + b"\xff\xd9"


def spy_decoders(monkeypatch) -> list[str]:
  """Records every pixel decoder Pillow creates (`Image._getdecoder`), by name."""
  calls: list[str] = []
  real = Image._getdecoder  # pylint: disable=protected-access

  def spy(mode, decoder_name, args, extra=()):
    calls.append(decoder_name)
    return real(mode, decoder_name, args, extra)

  monkeypatch.setattr(Image, "_getdecoder", spy)
  return calls
