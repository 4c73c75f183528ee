"""Peak memory of one image decode (decode, convert to RGB, resize), per image mode.

Writes one PNG (TIFF for the float mode) of `--size` x `--size` pixels per mode,
then decodes each in a fresh process through `decode_resized`, as the families
do, and reports how far the process's peak RSS rose above its RSS just before
(Linux: the peak is reset through /proc/self/clear_refs), in MiB and in bytes
per pixel, next to the size of the decoded image itself.

    python tools/decode_peak.py --size 9000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

# Decoded bytes per pixel of each mode as Pillow holds it (RGB is padded to 4).
MODES = {"RGB": 4, "RGBA": 4, "I;16": 2, "L": 1, "F": 4}

_CHILD = """
import io, json, sys
from PIL import Image
from bagel_grain.images import ImageTransform, decode_resized
target = ImageTransform(max_image_size=1024, min_image_size=512, image_stride=16)
small = io.BytesIO()
Image.new("RGB", (64, 64)).save(small, "PNG")
decode_resized(small.getvalue(), [(target, 1)], max_pixels_decode=10**6)  # loads Pillow's plugins
data = open(sys.argv[1], "rb").read()

def status(field):  # kB
  return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # the peak RSS (VmHWM) starts again from the RSS now
before = status("VmRSS:")
decode_resized(data, [(target, 1)], max_pixels_decode=int(sys.argv[2]))
print(json.dumps({"peak_growth": status("VmHWM:") - before, "file_bytes": len(data)}))
"""


def write_image(mode: str, size: int, folder: Path) -> Path:
  """A smooth image (quick to write, small file) of `mode`, `size` pixels square."""
  ramp = np.linspace(0, 1, size, dtype=np.float32)
  path = folder / f"{mode.replace(';', '_')}.{'tif' if mode == 'F' else 'png'}"
  if mode == "F":
    img = Image.fromarray(np.add.outer(ramp, ramp), mode="F")
  elif mode == "I;16":
    img = Image.fromarray((np.add.outer(ramp, ramp) * 32000).astype(np.uint16))
  else:
    grey = (np.add.outer(ramp, ramp) * 127).astype(np.uint8)
    img = Image.fromarray(grey, mode="L").convert(mode)
  img.save(path, compress_level=1) if path.suffix == ".png" else img.save(path)
  return path


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", type=int, default=9000)
  parser.add_argument("--modes", nargs="+", default=list(MODES))
  args = parser.parse_args(argv)
  pixels = args.size**2
  results = {}
  with tempfile.TemporaryDirectory(prefix="decode_peak_") as folder:
    for mode in args.modes:
      path = write_image(mode, args.size, Path(folder))
      out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(pixels)],
                           capture_output=True, text=True, check=True)
      m = json.loads(out.stdout.strip().splitlines()[-1])
      growth = m["peak_growth"]
      results[mode] = {"peak_growth_mib": round(growth / 2**20, 1),
                       "bytes_per_pixel": round(growth / pixels, 2),
                       "over_decoded_bytes_per_pixel": round(growth / pixels - MODES[mode], 2),
                       "file_mib": round(m["file_bytes"] / 2**20, 1)}
      print(f"{mode:5s} {args.size}x{args.size}: peak +{growth / 2**20:7.1f} MiB = "
            f"{growth / pixels:5.2f} B/px (decoded image {MODES[mode]} B/px; file "
            f"{m['file_bytes'] / 2**20:.1f} MiB)", flush=True)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
