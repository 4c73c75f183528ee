"""A realistic, deterministic benchmark dataset: photographs in the three upstream formats.

The photographs are the sample images scikit-image ships inside its package
(astronaut, coffee, chelsea, rocket, retina, ...), read from the installed
package's files (the `bench` extra installs it; nothing is fetched at run time).
Each benchmark image is a random crop of one photo, rescaled to a long side of
256-1536 px and re-encoded: mostly JPEG, some PNG, greyscale and RGBA, as in
web-scale data. Without scikit-image, procedural images stand in (and a line on
stderr says so); JPEG decoding of those costs more than of photographs.
"""

from __future__ import annotations

import io
import json
import random
import sys
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

from bagel_grain.tooling.demo_data import filler_sentence, write_tokenizer

SEED = 1536
PHOTO_NAMES = ("astronaut.png", "brick.png", "camera.png", "chelsea.png", "coffee.png",
               "coins.png", "grass.png", "gravel.png", "hubble_deep_field.jpg", "ihc.png",
               "moon.png", "motorcycle_left.png", "motorcycle_right.png", "retina.jpg",
               "rocket.jpg", "page.png")
KINDS = ("rgb_jpeg", "l_jpeg", "rgb_png", "rgba_png")
KIND_WEIGHTS = (80, 8, 7, 5)
ROW_GROUP_ROWS = 64


def _to_stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def load_photos(log: Callable[[str], None] = _to_stderr) -> list[Image.Image]:
  """The photographs as RGB images (procedural stand-ins without scikit-image)."""
  try:
    folder = resources.files("skimage").joinpath("data")
  except ModuleNotFoundError:
    log("scikit-image is not installed (pip install 'bagel_grain[bench]'): "
        "procedural images stand in for photographs")
    rng = np.random.default_rng(SEED)
    return [Image.fromarray(rng.integers(0, 256, (720, 960, 3), np.uint8)).resize((1440, 1080))
            for _ in range(6)]
  photos = []
  for name in PHOTO_NAMES:
    with Image.open(io.BytesIO(folder.joinpath(name).read_bytes())) as im:
      photos.append(im.convert("RGB"))
  return photos


class ImageMaker:
  """Random crops of the photos, rescaled and re-encoded; same bytes for the same seed."""

  def __init__(self, photos: list[Image.Image], seed: int,
               megapixels: tuple[float, float] | None = None):
    self._photos = photos
    self._r = random.Random(seed)
    self._megapixels = megapixels

  def size(self) -> tuple[int, int]:
    """A random size: a long side of 256-1536 px, or with `megapixels` (lo, hi) an area
    drawn uniformly in that range (a lab's photos: 0.3-2 MP)."""
    if self._megapixels is not None:
      area = self._r.uniform(*self._megapixels) * 1e6
      aspect = self._r.choice((1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 2 / 3, 9 / 16))
      return max(round((area * aspect) ** 0.5), 64), max(round((area / aspect) ** 0.5), 64)
    long_side = self._r.randint(256, 1536)
    aspect = self._r.choice((1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 2 / 3, 9 / 16))
    w = long_side if aspect >= 1 else round(long_side * aspect)
    h = long_side if aspect < 1 else round(long_side / aspect)
    return max(w, 64), max(h, 64)

  def image(self, size: tuple[int, int], kind: str | None = None, photo: int | None = None,
            shift: float = 0.0) -> bytes:
    r = self._r
    src = self._photos[r.randrange(len(self._photos)) if photo is None else photo]
    w, h = size
    scale = min(src.width / w, src.height / h) * r.uniform(0.5, 1.0)
    cw, ch = max(8, int(w * scale)), max(8, int(h * scale))
    x0 = int((src.width - cw) * min(1.0, r.random() + shift))
    y0 = r.randrange(0, src.height - ch + 1)
    img = src.crop((x0, y0, x0 + cw, y0 + ch)).resize(size, Image.BILINEAR)
    kind = kind or r.choices(KINDS, KIND_WEIGHTS)[0]
    out = io.BytesIO()
    if kind == "rgb_jpeg":
      img.save(out, "JPEG", quality=r.randint(80, 95))
    elif kind == "l_jpeg":
      img.convert("L").save(out, "JPEG", quality=r.randint(80, 95))
    elif kind == "rgb_png":
      img.save(out, "PNG", compress_level=1)
    else:
      alpha = Image.linear_gradient("L").resize(size)
      rgba = img.copy()
      rgba.putalpha(alpha)
      rgba.save(out, "PNG", compress_level=1)
    return out.getvalue()


def _write_parquet(path: Path, rows: list[dict], schema: pa.Schema) -> None:
  table = pa.Table.from_pylist(rows, schema=schema)
  pq.write_table(table, path, row_group_size=ROW_GROUP_ROWS, compression="none")


def make_bench_data(out_dir: str | Path, *, t2i_rows: int = 800, edit_rows: int = 200,
                    vlm_rows: int = 400, megapixels: tuple[float, float] | None = None,
                    log: Callable[[str], None] = _to_stderr) -> Path:
  """Writes the benchmark dataset (about 1 MB per T2I row at the defaults); returns its root.

  `megapixels` (lo, hi): photos of that many megapixels instead of a long side of
  256-1536 px (the lab-like mixture: 0.3-2). `log` gets one line per part written
  (default: stderr).
  """
  root = Path(out_dir)
  root.mkdir(parents=True, exist_ok=True)
  (root / ".complete").unlink(missing_ok=True)
  photos = load_photos(log)
  maker, r = ImageMaker(photos, SEED, megapixels), random.Random(SEED)
  write_tokenizer(root / "tokenizer")

  (root / "t2i").mkdir(exist_ok=True)
  shard_rows = 256
  t2i_schema = pa.schema([("image", pa.binary()), ("captions", pa.string())])
  for shard, start in enumerate(range(0, t2i_rows, shard_rows)):
    rows = [{"image": maker.image(maker.size()),
             "captions": json.dumps({f"caption_{i}": " ".join(filler_sentence(r)
                                                              for _ in range(r.randint(1, 4)))
                                     for i in range(r.randint(1, 3))})}
            for _ in range(start, min(t2i_rows, start + shard_rows))]
    _write_parquet(root / "t2i" / f"part-{shard:05d}.parquet", rows, t2i_schema)
    log(f"t2i: {start + len(rows)}/{t2i_rows} rows")

  (root / "edit").mkdir(exist_ok=True)
  edit_rows_data = []
  for _ in range(edit_rows):
    n, size, photo = r.randint(2, 5), maker.size(), r.randrange(len(photos))
    edit_rows_data.append({
        "image_list": [maker.image(size, "rgb_jpeg", photo, shift=0.05 * i) for i in range(n)],
        "instruction_list": [[filler_sentence(r) for _ in range(r.randint(1, 3))]
                             for _ in range(n - 1)]})
  edit_schema = pa.schema([("image_list", pa.list_(pa.binary())),
                           ("instruction_list", pa.list_(pa.list_(pa.string())))])
  _write_parquet(root / "edit" / "part-00000.parquet", edit_rows_data, edit_schema)
  log(f"edit: {edit_rows}/{edit_rows} rows")
  (root / "edit" / "parquet_info.json").write_text(json.dumps(
      {"edit/part-00000.parquet": {"num_row_groups": -(-edit_rows // ROW_GROUP_ROWS),
                                   "num_rows": edit_rows}}))

  images = root / "vlm" / "images"
  images.mkdir(parents=True, exist_ok=True)
  lines = []
  for i in range(vlm_rows):
    names = []
    for j in range(1 if r.random() < 0.8 else r.randint(2, 3)):
      data = maker.image(maker.size())
      extension = "jpg" if data.startswith(b"\xff\xd8") else "png"
      name = f"img_{i:05d}_{j}.{extension}"
      (images / name).write_bytes(data)
      names.append(f"images/{name}")
    turns = [{"from": "human", "value": "<image>\n" * len(names) + filler_sentence(r)},
             {"from": "gpt", "value": " ".join(filler_sentence(r) for _ in range(r.randint(2, 8)))}]
    lines.append(json.dumps({"image": names if len(names) > 1 else names[0],
                             "conversations": turns}))
  (root / "vlm" / "sft.jsonl").write_text("\n".join(lines) + "\n")
  log(f"vlm: {vlm_rows}/{vlm_rows} rows")

  info = {"t2i_pretrain": {"bench_t2i": {"data_dir": "t2i"}},
          "unified_edit": {"bench_edit": {"data_dir": "edit",
                                          "parquet_info_path": "edit/parquet_info.json"}},
          "vlm_sft": {"bench_vlm": {"data_dir": "vlm", "jsonl_path": "vlm/sft.jsonl"}}}
  (root / "dataset_info.yaml").write_text(yaml.safe_dump(info, sort_keys=False))
  (root / ".complete").write_text("")
  return root
