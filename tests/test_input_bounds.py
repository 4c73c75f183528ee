"""Memory and time per record stay bounded: each limit is checked before the expensive work.

Text longer than any packable sample is dropped before tokenizing; an image file
that is too large or not a regular file is dropped before it is opened or read;
one decode holds the decoded image plus one RGB image; parquet row groups are
cached up to a byte budget, as Arrow tables only.
"""

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from bagel_grain import images
from bagel_grain.config import config_from_dict
from bagel_grain.drops import Dropped
from bagel_grain.pipeline import build_pipeline, family_transform, pipeline_stats
from bagel_grain.sources.parquet import DEFAULT_CACHE_BYTES, ParquetRowSource
from bagel_grain.sources.records import Record
from shipped_demo import shipped_demo_raw
from deadline import deadline
from vlm_files import png

ROOT = Path(__file__).resolve().parents[1]
BIG_TEXT = "many words " * 500_000  # 5.5 MB


class CountingTokenizer:
  """The demo tokenizer, counting the characters it was asked to tokenize."""

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer
    self.special = tokenizer.special
    self.longest_token_chars = tokenizer.longest_token_chars
    self.chars = 0

  def encode_batch(self, texts):
    self.chars += sum(len(t) for t in texts)
    return self._tokenizer.encode_batch(texts)

  def encode(self, text):
    return self.encode_batch([text])[0]


def _record(fields, dataset=0):
  return Record(index=0, epoch=0, record_id="r#0", dataset=dataset, fields=fields)


def _vlm_line(image, text="What is it?"):
  return json.dumps({"image": image, "conversations": [
      {"from": "human", "value": "<image>" + text}, {"from": "gpt", "value": "A square."}]})


@pytest.fixture
def vlm_config(demo_dir, tmp_path):
  """The demo config with the VLM group's data_dir at a folder of our own."""
  data = tmp_path / "vlm"
  data.mkdir()
  (data / "a.png").write_bytes(png())
  raw = shipped_demo_raw(demo_dir)
  raw["dataset_info"]["vlm_sft"]["demo_vlm"]["data_dir"] = str(data)
  return config_from_dict(raw, file="demo.yaml", base_dir=str(demo_dir)), data


# --- text ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["t2i_pretrain", "unified_edit", "vlm_sft"])
def test_text_longer_than_any_sample_is_dropped_before_tokenizing(family, vlm_config,
                                                                  demo_tokenizer):
  cfg, _ = vlm_config
  tokenizer = CountingTokenizer(demo_tokenizer)
  group = [g.name for g in cfg.groups].index(family)
  transform = family_transform(cfg, group, tokenizer)
  fields = {"t2i_pretrain": {"image": png(), "captions": json.dumps({"a": BIG_TEXT})},
            "unified_edit": {"image_list": [png(), png((0, 0, 200))],
                             "instruction_list": [[BIG_TEXT]]},
            "vlm_sft": _vlm_line("a.png", BIG_TEXT).encode()}[family]
  out = transform.random_map(_record(fields), np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "text_too_long", out
  assert tokenizer.chars == 0


def test_text_bound_is_the_longest_token_times_the_sample_budget(vlm_config, demo_tokenizer):
  cfg, _ = vlm_config
  longest = demo_tokenizer.longest_token_chars
  # The bound's premise: no token stands for more characters than the longest one.
  assert all(len(demo_tokenizer.decode([i])) <= longest
             for i in range(demo_tokenizer.vocab_size))
  group = [g.name for g in cfg.groups].index("vlm_sft")
  transform = family_transform(cfg, group, CountingTokenizer(demo_tokenizer))
  bound = cfg.max_num_tokens_per_sample * longest
  assert transform.max_text_chars == bound
  prompt_and_answer = len("What is it?") + len("A square.")
  fits = _vlm_line("a.png", "What is it?" + "x" * (bound - prompt_and_answer))
  over = _vlm_line("a.png", "What is it?" + "x" * (bound - prompt_and_answer + 1))
  assert transform.random_map(_record(over.encode()), np.random.default_rng(0)).reason == \
      "text_too_long"
  out = transform.random_map(_record(fits.encode()), np.random.default_rng(0))
  assert getattr(out, "reason", None) != "text_too_long"


# --- image files -----------------------------------------------------------------------


def _vlm(cfg, tokenizer):
  return family_transform(cfg, [g.name for g in cfg.groups].index("vlm_sft"), tokenizer)


def test_image_file_over_max_image_bytes_is_dropped_unread(vlm_config, demo_tokenizer):
  cfg, data = vlm_config
  with open(data / "huge.png", "wb") as f:
    f.truncate(cfg.max_image_bytes + 1)  # sparse: no disk used
  tokenizer = CountingTokenizer(demo_tokenizer)
  out = _vlm(cfg, tokenizer).random_map(_record(_vlm_line("huge.png").encode()),
                                        np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "file_too_large", out
  assert str(cfg.max_image_bytes) in out.detail


def _special_files(data: Path) -> dict[str, Path]:
  fifo = data / "fifo.png"
  os.mkfifo(fifo)
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.bind(str(data / "socket.png"))
  files = {"fifo": fifo, "socket": data / "socket.png"}
  if os.geteuid() == 0:  # a device node needs root
    os.mknod(data / "zero.png", 0o600 | 0o020000, os.makedev(1, 5))  # like /dev/zero
    files["device"] = data / "zero.png"
  return files


def test_fifo_socket_and_device_are_dropped_without_being_opened(vlm_config, demo_tokenizer):
  cfg, data = vlm_config
  transform = _vlm(cfg, demo_tokenizer)
  for kind, path in _special_files(data).items():
    for line in (_vlm_line(path.name), json.dumps({"video": path.name, "conversations": [
        {"from": "human", "value": "<video>"}, {"from": "gpt", "value": "ok"}]})):
      with deadline(20):  # opening a FIFO for reading would wait for a writer forever
        out = transform.random_map(_record(line.encode()), np.random.default_rng(0))
      assert isinstance(out, Dropped) and out.reason == "not_a_regular_file", (kind, out)


@pytest.mark.parametrize("workers", [0, 2])
def test_fifo_in_the_data_is_one_counted_drop_with_and_without_workers(demo_dir, demo_tokenizer,
                                                                      tmp_path, workers):
  shutil.copytree(demo_dir, tmp_path / "demo")
  vlm = tmp_path / "demo" / "vlm"
  os.mkfifo(vlm / "fifo.png")
  with open(vlm / "sft.jsonl", "a") as f:
    f.write(_vlm_line("fifo.png") + "\n")
  raw = {**shipped_demo_raw(tmp_path / "demo"), "num_epochs": 1}
  cfg = config_from_dict(raw, file="demo.yaml", base_dir=str(tmp_path / "demo"))
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=workers))
  try:
    with deadline(180):
      for _ in it:
        pass
    stats = pipeline_stats(it)
  finally:
    it.close()
  assert stats["drops"]["vlm_sft"] == {"not_a_regular_file": 1}
  assert stats["drawn"] == stats["packed"] + stats["dropped"]


# --- decoding --------------------------------------------------------------------------


def _reference_rgb(img: Image.Image) -> np.ndarray:
  """The whole image to RGB with Pillow and numpy, without strips or a grey shortcut."""
  if img.mode == "I;16":
    grey = np.clip(np.rint(np.asarray(img) / 257.0), 0, 255).astype(np.uint8)
    return np.repeat(grey[:, :, None], 3, axis=2)
  if img.mode == "RGBA":
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, img).convert("RGB"))
  return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("mode", ["RGBA", "I;16", "L", "LA", "P", "CMYK", "RGB"])
def test_strips_and_grey_shortcut_give_the_whole_image_pixels(mode, monkeypatch):
  monkeypatch.setattr(images, "_STRIP_PIXELS", 50)  # strips of one row for a 61 x 37 image
  rng = np.random.default_rng(7)
  channels = {"RGBA": 4, "LA": 2, "CMYK": 4, "RGB": 3}.get(mode, 1)
  if mode == "I;16":
    img = Image.fromarray(rng.integers(0, 65536, (37, 61), dtype=np.uint16))
  else:
    values = rng.integers(0, 256, (37, 61, channels), dtype=np.uint8)
    img = Image.fromarray(values.squeeze(-1) if channels == 1 else values,
                          mode="L" if mode == "P" else mode)
    if mode == "P":
      img = img.convert("P")
  assert img.mode == mode
  data = io.BytesIO()
  img.save(data, "TIFF" if mode == "CMYK" else "PNG")
  target = images.ImageTransform(max_image_size=48, min_image_size=16, image_stride=16)
  [got] = images.decode_resized(data.getvalue(), [(target, 1)], max_pixels_decode=10**6)
  decoded = Image.open(io.BytesIO(data.getvalue()))
  want = Image.fromarray(_reference_rgb(decoded)).resize(
      images.resize_size(61, 37, target), Image.BICUBIC)
  np.testing.assert_array_equal(got, np.asarray(want))


DECODE_LIMITS = {"I;16": 3.0, "RGB": 3.0, "RGBA": 5.0}  # bytes per pixel over the decoded image


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable peak RSS")
def test_one_decode_holds_the_decoded_image_plus_one_rgb_image():
  out = subprocess.run([sys.executable, str(ROOT / "tools" / "decode_peak.py"), "--size", "3000",
                        "--modes", *DECODE_LIMITS], capture_output=True, text=True, timeout=300,
                       check=True)
  measured = json.loads(out.stdout.strip().splitlines()[-1])
  for mode, limit in DECODE_LIMITS.items():  # Pillow holds RGB in 4 bytes per pixel
    assert measured[mode]["over_decoded_bytes_per_pixel"] <= limit, (mode, measured[mode])


# --- parquet row groups ----------------------------------------------------------------


def _parquet_files(folder: Path, rows: int, row_bytes: int, count: int = 3) -> list[str]:
  rng = np.random.default_rng(0)
  paths = []
  for f in range(count):
    payload = pa.array([rng.bytes(row_bytes) for _ in range(rows)], pa.binary())
    path = folder / f"part-{f}.parquet"
    pq.write_table(pa.table({"id": [f"{f}:{i}" for i in range(rows)], "image": payload}), path,
                   row_group_size=rows)
    paths.append(str(path))
  return paths


def test_row_group_cache_is_bounded_in_bytes_and_holds_arrow_tables(tmp_path):
  files = _parquet_files(tmp_path, rows=50, row_bytes=4000)  # about 200 KB per row group
  expected = [row for path in files for row in pq.read_table(path).to_pylist()]
  small = ParquetRowSource(files, ["id", "image"], cache_bytes=250_000)
  for _ in range(2):
    assert [small[i] for i in range(len(small))] == expected
  assert small.row_group_reads == 6  # one fits at a time: each pass reads all three
  held = small._cache.get((files[-1], 0))  # the last row group read
  assert isinstance(held, pa.Table) and small._cache.held_bytes == held.nbytes <= 250_000
  roomy = ParquetRowSource(files, ["id", "image"], cache_bytes=10**9)
  for _ in range(2):
    assert [roomy[i] for i in range(len(roomy))] == expected
  assert roomy.row_group_reads == 3



def test_the_default_cache_keeps_the_row_group_in_use_while_the_next_one_is_read(tmp_path):
  # Read-ahead steps into the next row group while rows of the current one are still to be
  # served: with row groups of up to half the default, neither is read twice, and what a
  # pass leaves behind is let go (three row groups do not fit).
  size = DEFAULT_CACHE_BYTES // 2 - (1 << 20)
  files = _parquet_files(tmp_path, rows=4, row_bytes=size // 4)
  source = ParquetRowSource(files, ["id", "image"])
  order = [0, 1, 4, 2, 3, 5, 8, 6, 7, 9, 10, 11]  # a row of the next row group comes early
  assert sorted(order) == list(range(len(source)))
  for i in order:
    source[i]  # pylint: disable=pointless-statement
  assert source.row_group_reads == 3
  assert source._cache.held_bytes <= DEFAULT_CACHE_BYTES

_PARQUET_PEAK = """
import glob, json, sys
from bagel_grain.sources.parquet import DEFAULT_CACHE_BYTES, ParquetRowSource

def status(field):
  return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

source = ParquetRowSource(sorted(glob.glob(sys.argv[1] + "/*.parquet")), ["id", "image"],
                          cache_bytes=1)
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")
before = status("VmRSS:")
for _ in range(2):
  for i in range(len(source)):
    source[i]
print(json.dumps({"peak_growth": status("VmHWM:") - before}))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable peak RSS")
def test_large_row_groups_keep_memory_near_one_row_group(tmp_path):
  _parquet_files(tmp_path, rows=600, row_bytes=50_000)  # 3 row groups of 30 MB
  out = subprocess.run([sys.executable, "-c", _PARQUET_PEAK, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, check=True)
  growth = json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"]
  # Decoding one row group takes a few times its size; nothing else accumulates.
  assert growth <= 6 * 30e6, growth / 30e6
