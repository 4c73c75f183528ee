"""A small VLM data directory with the awkward cases (corrupt file, symlink out, frames)."""

import io
import os
from pathlib import Path

from PIL import Image


def png(colour=(200, 0, 0), size=(64, 64)) -> bytes:
  buf = io.BytesIO()
  Image.new("RGB", size, colour).save(buf, "PNG")
  return buf.getvalue()


def write_vlm_files(root: Path) -> Path:
  """`root/data` with a.png, corrupt.png, link.png (-> root/outside.png), clip/frame_1..10."""
  data = root / "data"
  data.mkdir()
  (data / "a.png").write_bytes(png((200, 0, 0), (112, 112)))
  (data / "corrupt.png").write_bytes(b"\x89PNG but not really")
  (root / "outside.png").write_bytes(png((0, 200, 0)))
  os.symlink(root / "outside.png", data / "link.png")
  (data / "clip").mkdir()
  for n in range(1, 11):  # frame_1 .. frame_10, red rising with N
    Image.new("RGB", (56, 56), (20 * n, 0, 0)).save(data / "clip" / f"frame_{n}.jpg")
  return data
