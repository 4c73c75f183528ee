"""The demo dataset: deterministic bytes and every shape of row the families must handle."""

import hashlib
import io
import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from bagel_grain.tooling import demo_data


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return demo_data.make_sample_data(tmp_path_factory.mktemp("demo_a"))


def _digests(root):
  return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob("*")) if p.is_file()}


def _vlm_rows(root):
  text = (root / "vlm" / "sft.jsonl").read_bytes()
  assert b"\r" not in text
  return [json.loads(line) for line in text.decode().splitlines()]


def _open(data):
  img = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
  img.load()
  return img


def _kind(img):
  """(format, mode, has transparency key) - the properties the resize path branches on."""
  return img.format, img.mode, "transparency" in img.info


def test_two_runs_write_identical_bytes(root, tmp_path):
  again = demo_data.make_sample_data(tmp_path / "demo_b")
  assert _digests(again) == _digests(root)


def test_layout_and_dataset_info(root):
  assert (root / ".complete").exists()
  info = yaml.safe_load((root / "dataset_info.yaml").read_text())
  assert set(info) == {"t2i_pretrain", "unified_edit", "vlm_sft"}
  t2i = info["t2i_pretrain"]["demo_t2i"]
  assert sorted(p.name for p in (root / t2i["data_dir"]).glob("*.parquet")) == [
    "part-00000.parquet", "part-00001.parquet"]
  assert t2i["num_files"] == 2
  assert t2i["num_total_samples"] == sum(
    pq.read_metadata(p).num_rows for p in (root / t2i["data_dir"]).glob("*.parquet"))
  edit = info["unified_edit"]["demo_edit"]
  assert (root / edit["parquet_info_path"]).is_file()
  vlm = info["vlm_sft"]["demo_vlm"]
  assert vlm["num_total_samples"] == len(_vlm_rows(root))
  assert (root / vlm["jsonl_path"]).is_file() and (root / vlm["data_dir"]).is_dir()


def test_tokenizer_files(root):
  tok = json.loads((root / "tokenizer" / "tokenizer.json").read_text())
  added = {t["content"]: t for t in tok["added_tokens"]}
  assert set(added) == set(demo_data.SPECIAL_TOKENS)
  assert all(t["special"] for t in added.values())
  assert 1000 < len(tok["model"]["vocab"]) <= demo_data.TOKENIZER_VOCAB_SIZE
  assert tok["pre_tokenizer"]["type"] == "ByteLevel"


def test_t2i_parquet(root):
  kinds, empty, sizes = set(), 0, set()
  for path in sorted((root / "t2i").glob("*.parquet")):
    assert pq.ParquetFile(path).metadata.num_row_groups > 1
    table = pq.read_table(path)
    assert table.column_names == ["image", "captions"]
    for row in table.to_pylist():
      captions = json.loads(row["captions"])
      assert all(re.fullmatch(r"caption_\d", k) and v for k, v in captions.items())
      empty += not captions
      img = _open(row["image"])
      kinds.add(_kind(img))
      sizes.add(img.size)
  assert empty == 2
  assert kinds == {("JPEG", "RGB", False), ("JPEG", "L", False), ("PNG", "RGB", False),
                   ("PNG", "RGBA", False), ("PNG", "P", False), ("PNG", "P", True)}
  assert all(64 <= s <= 640 for size in sizes for s in size)
  aspects = [w / h for w, h in sizes]
  assert max(aspects) >= 8 and min(aspects) <= 1 / 8


def test_rgba_images_have_partial_alpha(root):
  row = next(r for r in pq.read_table(root / "t2i" / "part-00000.parquet").to_pylist()
             if _open(r["image"]).mode == "RGBA")
  alpha = np.asarray(_open(row["image"]))[..., 3]
  assert ((alpha > 0) & (alpha < 255)).mean() > 0.5


def test_edit_parquet_and_info(root):
  path = root / "edit" / "part-00000.parquet"
  meta = pq.read_metadata(path)
  assert meta.num_row_groups > 1
  info = json.loads((root / "edit" / "parquet_info.json").read_text())
  assert info == {"edit/part-00000.parquet": {"num_row_groups": meta.num_row_groups,
                                              "num_rows": meta.num_rows}}
  rows = pq.read_table(path).to_pylist()
  assert {len(r["image_list"]) for r in rows} == {2, 3, 4, 5}
  for row in rows:
    assert len(row["instruction_list"]) == len(row["image_list"]) - 1
    assert all(1 <= len(step) <= 3 and all(step) for step in row["instruction_list"])
    images = [_open(b) for b in row["image_list"]]
    assert len({img.size for img in images}) == 1


def _placeholders(row, tag):
  return sum(t["value"].count(tag) for t in row["conversations"] if t["from"] == "human")


def test_vlm_jsonl_has_every_row_kind(root):
  rows = _vlm_rows(root)
  data_dir = root / "vlm"
  kinds = set()
  for row in rows:
    roles = [t["from"] for t in row["conversations"]]
    assert roles == ["human", "gpt"] * (len(roles) // 2) and roles
    if "video" in row:
      folder = data_dir / row["video"]
      assert row["video"].endswith("/")
      frames = sorted(folder.iterdir())
      assert 10 <= len(frames) <= 16
      assert {f.name for f in frames} == {f"frame_{i}.jpg" for i in range(1, len(frames) + 1)}
      assert _placeholders(row, "<video>") == 1
      kinds.add("video")
      continue
    images = row.get("image")
    if images is None:
      assert _placeholders(row, "<image>") == 0
      kinds.add("text_only")
      continue
    paths = [images] if isinstance(images, str) else images
    assert all((data_dir / p).is_file() and not p.startswith("/") for p in paths)
    n_ph = _placeholders(row, "<image>")
    if n_ph > len(paths):
      kinds.add("more_placeholders")
    elif n_ph < len(paths):
      kinds.add("fewer_placeholders")
    elif len(roles) > 2:
      kinds.add("multi_turn")
    else:
      kinds.add("multi_image" if len(paths) > 1 else "single_image")
  assert kinds == {"single_image", "multi_image", "multi_turn", "more_placeholders",
                   "fewer_placeholders", "text_only", "video"}
  assert len(rows) == 60
  assert sum("video" in r for r in rows) == 2


def test_vlm_images_decode_with_every_mode(root):
  kinds = set()
  for path in sorted((root / "vlm").rglob("*")):
    if path.suffix in (".jpg", ".png"):
      img = _open(path)
      assert img.format == ("JPEG" if path.suffix == ".jpg" else "PNG")
      kinds.add(_kind(img))
  assert {m for _, m, _ in kinds} == {"RGB", "L", "RGBA", "P"}
  assert ("PNG", "P", True) in kinds and ("PNG", "P", False) in kinds


def test_video_demo_has_a_video_file_and_a_frame_folder(root):
  import av  # a plain dependency: the demo writes and reads H.264

  rows = [json.loads(line) for line in (root / "video" / "video.jsonl").read_text().splitlines()]
  videos = {row["video"] for row in rows}
  assert videos == {"clips/clip.mp4", "frames/clip/"}
  with av.open(str(root / "video" / "clips" / "clip.mp4")) as container:
    stream = container.streams.video[0]
    assert stream.codec_context.name == "h264" and stream.frames == demo_data.VIDEO_DEMO_FILE_FRAMES
    keys = [p.is_keyframe for p in container.demux(stream) if p.size]
    assert sum(keys) == demo_data.VIDEO_DEMO_FILE_FRAMES // 12  # several places to seek to
  frames = sorted(p.name for p in (root / "video" / "frames" / "clip").iterdir())
  assert len(frames) == demo_data.VIDEO_DEMO_FOLDER_FRAMES
  info = yaml.safe_load((root / "dataset_info.yaml").read_text())
  assert set(info["vlm_sft"]) == {"demo_vlm", "demo_video"}
  assert info["vlm_sft"]["demo_video"]["num_total_samples"] == len(rows)


def test_video_demo_config_packs_both_videos(root):
  """What `make demo` runs second: every row packed, frames from the file and the folder."""
  from bagel_grain.config import load_config
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.tokenizer import load_tokenizer

  cfg = load_config(root / demo_data.VIDEO_DEMO_CONFIG)
  assert cfg.group("vlm_sft").options.frame_sampler.sample == "middle"
  tokenizer = load_tokenizer(root / "tokenizer" / "tokenizer.json")
  records = set()
  with iter(build_pipeline(cfg, tokenizer, batch_size=1, workers=0)) as it:
    for _ in range(4):
      batch = next(it)
      assert batch["num_vit_tokens"].sum() > 0
      records.update(k[3].rsplit(":", 1)[1] for row in batch["sample_keys"] for k in row)
    stats = pipeline_stats(it)
  assert records == {"1", "2", "3", "4"} and not stats["drops_by_reason"]
