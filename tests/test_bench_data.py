"""make-bench-data: photographs read from the installed scikit-image package, never fetched."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from bagel_grain.tooling import bench_data


@pytest.fixture
def no_subprocess(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError(f"make-bench-data started a process: {args}")
  monkeypatch.setattr(subprocess, "run", refuse)
  monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture
def fake_scikit_image(tmp_path, monkeypatch):
  """An installed `skimage` package holding the photo files, each one flat colour."""
  data = tmp_path / "site" / "skimage" / "data"
  data.mkdir(parents=True)
  (data.parent / "__init__.py").write_text("")
  colours = {}
  for i, name in enumerate(bench_data.PHOTO_NAMES):
    colours[name] = (i * 15, 255 - i * 15, 100)
    Image.new("RGB", (320, 240), colours[name]).save(data / name)
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.delitem(sys.modules, "skimage", raising=False)
  return colours


def test_photos_are_read_from_the_installed_package(fake_scikit_image, no_subprocess):
  lines = []
  photos = bench_data.load_photos(lines.append)
  assert lines == []
  assert len(photos) == len(bench_data.PHOTO_NAMES)
  for photo, name in zip(photos, bench_data.PHOTO_NAMES):
    assert photo.mode == "RGB" and photo.size == (320, 240)
    pixel = np.asarray(photo)[120, 160].astype(int)
    assert np.abs(pixel - fake_scikit_image[name]).max() <= 2, name  # JPEG rounding


def test_without_scikit_image_procedural_images_stand_in_and_say_so(monkeypatch, no_subprocess):
  monkeypatch.setitem(sys.modules, "skimage", None)  # any import of it fails
  lines = []
  photos = bench_data.load_photos(lines.append)
  assert len(lines) == 1 and "scikit-image is not installed" in lines[0]
  assert "bagel_grain[bench]" in lines[0]
  assert photos and all(p.mode == "RGB" for p in photos)


def test_a_small_dataset_is_written_with_a_line_per_part(fake_scikit_image, no_subprocess,
                                                         tmp_path):
  lines = []
  root = bench_data.make_bench_data(tmp_path / "bench", t2i_rows=3, edit_rows=2, vlm_rows=2,
                                    log=lines.append)
  assert lines == ["t2i: 3/3 rows", "edit: 2/2 rows", "vlm: 2/2 rows"]
  assert (root / ".complete").exists()
  info = yaml.safe_load((root / "dataset_info.yaml").read_text())
  assert set(info) == {"t2i_pretrain", "unified_edit", "vlm_sft"}


def test_megapixels_sets_every_image_area_in_range(fake_scikit_image, no_subprocess, tmp_path):
  """The lab-like mixture (tools/ceiling_bars.py): photos of 0.3-2 MP in all three families."""
  import io  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  root = bench_data.make_bench_data(tmp_path / "lab", t2i_rows=4, edit_rows=2, vlm_rows=3,
                                    megapixels=(0.3, 2.0), log=lambda line: None)
  blobs = list(pq.read_table(root / "t2i" / "part-00000.parquet")["image"].to_pylist())
  blobs += [b for row in pq.read_table(root / "edit" / "part-00000.parquet")["image_list"]
            .to_pylist() for b in row]
  blobs += [p.read_bytes() for p in (root / "vlm" / "images").iterdir()]
  assert len(blobs) >= 4 + 2 * 2 + 3
  for blob in blobs:
    w, h = Image.open(io.BytesIO(blob)).size
    assert 0.29e6 <= w * h <= 2.01e6, (w, h)
