"""Bad records mixed into good data: skipped, counted by reason, never read outside data_dir.

The corpus is written here (docs/design.md, section 8): demo rows and images plus, for each
kind of bad input, records that carry it. One epoch of the pipeline must pack
every good record once, count every bad one under its reason, and keep the
counters balanced after every batch.
"""

import builtins
import collections
import dataclasses
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from bagel_grain import fs
from bagel_grain.config import config_from_dict
from bagel_grain.errors import GroupExhaustedError
from bagel_grain.pipeline import build_pipeline, pipeline_stats

CONFIGS = Path(__file__).resolve().parents[1] / "bagel_grain" / "configs"  # the shipped demo.yaml
MAX_DECODE = 4_000_000  # the corpus config's cap: 4 Mpx


# --- image bytes ------------------------------------------------------------------------


def encode(img: Image.Image, fmt: str) -> bytes:
  buf = io.BytesIO()
  img.save(buf, fmt)
  return buf.getvalue()


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
  rng = np.random.default_rng(seed)
  return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_bomb(width: int, height: int) -> bytes:
  """A PNG declaring `width x height` RGB pixels in a few hundred bytes (IDAT holds one row)."""
  def chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
  ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  idat = zlib.compress(b"\x00" * 1024)
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


GARBAGE = b"this is not an image at all"
BIG = encode(Image.new("RGB", (2100, 2000), (10, 120, 30)), "PNG")  # valid, 4.2 Mpx > cap
BOMB = png_bomb(100_000, 100_000)
TRUNCATED_JPEG = encode(noise(160, 128, 1), "JPEG")[:1500]
TRUNCATED_PNG = encode(noise(160, 128, 2), "PNG")[:20000]


# --- the corpus -----------------------------------------------------------------------------


@dataclasses.dataclass
class Corpus:
  root: Path
  dataset_info: dict
  expected_drops: dict  # group -> Counter of reasons
  good: dict  # group -> set of record ids (basename form) that must be packed
  bad: dict  # group -> set of record ids that must not be packed
  notes: dict  # group -> Counter of notes the good records carry

  @property
  def records(self) -> dict:
    return {g: len(self.good[g]) + len(self.bad[g]) for g in self.good}


def short_id(record: str) -> str:
  """A record id (`demo_t2i/part-00000.parquet#3`: dataset name, file under its root)."""
  assert not os.path.isabs(record), record  # never where the data lies
  return record


def _write_parquet(path: Path, columns: dict, types: dict, row_group_size: int = 8) -> None:
  table = pa.table({k: pa.array(v, types[k]) for k, v in columns.items()})
  pq.write_table(table, path, row_group_size=row_group_size)


def _interleave(good: list, bad: list) -> list:
  """Bad entries spread evenly between good ones (one epoch sees them everywhere)."""
  out, step = list(good), max(1, len(good) // max(1, len(bad)))
  for k, item in enumerate(bad):
    out.insert(min(len(out), k * (step + 1) + step // 2), item)
  return out


def _t2i(corpus: Corpus, demo_dir: Path) -> None:
  out = corpus.root / "t2i"
  out.mkdir()
  demo = pq.read_table(demo_dir / "t2i" / "part-00000.parquet").to_pylist()[:20]
  ok = json.dumps({"a": "A plain test picture."})
  good = [("good", r["image"], r["captions"]) for r in demo]
  good.append(("good_empty_caption", encode(noise(64, 48, 3), "PNG"), "{}"))
  bad = [("bad_image", GARBAGE, ok), ("too_many_pixels", BIG, ok), ("too_many_pixels", BOMB, ok),
         ("truncated_image", TRUNCATED_JPEG, ok), ("truncated_image", TRUNCATED_PNG, ok),
         ("wrong_type", None, ok),  # image missing (null)
         ("bad_caption", good[0][1], "{not json"), ("bad_caption", good[0][1], '["a list"]'),
         ("bad_caption", good[0][1], '{"a": 3}'), ("bad_caption", good[0][1], None),
         ("bad_caption", good[0][1], '{"a": "\\ud800 lone surrogate"}')]
  rows = _interleave(good, bad)
  _write_parquet(out / "part-00000.parquet",
                 {"image": [r[1] for r in rows], "captions": [r[2] for r in rows]},
                 {"image": pa.binary(), "captions": pa.string()})
  # Wrong column types: `image` holding a string, `captions` a number.
  _write_parquet(out / "part-00001.parquet", {"image": ["images/a.png", "b.png"],
                                              "captions": [ok, ok]},
                 {"image": pa.string(), "captions": pa.string()})
  _write_parquet(out / "part-00002.parquet", {"image": [good[1][1]], "captions": [7]},
                 {"image": pa.binary(), "captions": pa.int64()})
  labelled = ([(f"part-00000.parquet#{i}", r[0]) for i, r in enumerate(rows)]
              + [("part-00001.parquet#0", "wrong_type"), ("part-00001.parquet#1", "wrong_type"),
                 ("part-00002.parquet#0", "bad_caption")])
  _account(corpus, "t2i_pretrain", "demo_t2i", labelled)
  corpus.notes["t2i_pretrain"]["empty_caption"] += sum(json.loads(r[2]) == {} for r in good)


def _edit(corpus: Corpus, demo_dir: Path) -> None:
  out = corpus.root / "edit"
  out.mkdir()
  demo = pq.read_table(demo_dir / "edit" / "part-00000.parquet").to_pylist()[:10]
  good = [("good", r["image_list"], r["instruction_list"]) for r in demo]
  img = good[0][1][0]
  bad = [("bad_edit_lists", [img] * 3, [["one step for two"]]),  # lengths disagree
         ("bad_edit_lists", [img], []),  # fewer than 2 images
         ("bad_edit_lists", [img, img], [[]]),  # an empty paraphrase list
         ("bad_edit_lists", [img, img], None),
         ("bad_edit_lists", None, [["step"]]),
         ("bad_image", [GARBAGE, GARBAGE], [["step"]]),
         ("too_many_pixels", [BIG, BIG], [["step"]]),
         ("wrong_type", [None, None], [["step"]])]
  rows = _interleave(good, bad)
  binary_lists, nested = pa.list_(pa.binary()), pa.list_(pa.list_(pa.string()))
  _write_parquet(out / "part-00000.parquet",
                 {"image_list": [r[1] for r in rows], "instruction_list": [r[2] for r in rows]},
                 {"image_list": binary_lists, "instruction_list": nested})
  # A string where a list of paraphrases belongs; image_list holding strings.
  _write_parquet(out / "part-00001.parquet", {"image_list": [[img, img]],
                                              "instruction_list": [["add a red square"]]},
                 {"image_list": binary_lists, "instruction_list": pa.list_(pa.string())})
  _write_parquet(out / "part-00002.parquet", {"image_list": [["a.png", "b.png"]],
                                              "instruction_list": [[["step"]]]},
                 {"image_list": pa.list_(pa.string()), "instruction_list": nested})
  labelled = ([(f"part-00000.parquet#{i}", r[0]) for i, r in enumerate(rows)]
              + [("part-00001.parquet#0", "bad_edit_lists"), ("part-00002.parquet#0", "wrong_type")])
  _account(corpus, "unified_edit", "demo_edit", labelled)


def _turns(question: str = "<image>\nDescribe the picture.", answer: str = "A picture."):
  return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _vlm(corpus: Corpus, demo_dir: Path, tokenizer) -> None:
  data = corpus.root / "vlm"
  shutil.copytree(demo_dir / "vlm", data)
  outside = corpus.root / "outside"
  images, videos = data / "images", data / "videos"
  (images / "garbage.png").write_bytes(GARBAGE)
  (images / "big.png").write_bytes(BIG)
  (images / "bomb.png").write_bytes(BOMB)
  (images / "truncated.jpg").write_bytes(TRUNCATED_JPEG)
  os.symlink(outside / "sentinel.png", images / "link.png")
  (videos / "empty").mkdir()
  (videos / "junk.mp4").write_bytes(GARBAGE)
  (videos / "corrupt").mkdir()
  (videos / "mixed").mkdir()
  for n in range(1, 5):
    (videos / "corrupt" / f"frame_{n}.jpg").write_bytes(GARBAGE)
    if n < 4:
      Image.new("RGB", (96, 64), (30 * n, 0, 0)).save(videos / "mixed" / f"frame_{n}.jpg")
  os.symlink(outside / "frames" / "frame_1.jpg", videos / "mixed" / "frame_4.jpg")
  os.symlink(outside / "frames", videos / "linkdir")
  long_answer = "The picture shows a red circle in the top left corner. " * 800
  assert len(tokenizer.encode(long_answer)) > 8192  # the config's max_num_tokens_per_sample

  def line(**row):
    return json.dumps(row)

  bad = [
      ("bad_image", line(image="images/garbage.png", conversations=_turns())),
      ("too_many_pixels", line(image="images/big.png", conversations=_turns())),
      ("too_many_pixels", line(image="images/bomb.png", conversations=_turns())),
      ("truncated_image", line(image="images/truncated.jpg", conversations=_turns())),
      ("missing_file", line(image="images/nope.png", conversations=_turns())),
      ("path_outside_data_dir", line(image="../outside/sentinel.png", conversations=_turns())),
      ("path_outside_data_dir", line(image=str(outside / "sentinel.png"), conversations=_turns())),
      ("path_outside_data_dir", line(image="images/link.png", conversations=_turns())),
      ("path_outside_data_dir", line(image="images/../../outside/sentinel.png",
                                     conversations=_turns())),
      ("path_outside_data_dir", line(video="../outside/frames/",
                                     conversations=_turns("<video>\nWhat happens?"))),
      ("path_outside_data_dir", line(video="videos/linkdir/",
                                     conversations=_turns("<video>\nWhat happens?"))),
      ("path_outside_data_dir", line(video="videos/mixed/",
                                     conversations=_turns("<video>\nWhat happens?"))),
      ("bad_json", "not json"),
      ("bad_json", '["a", "list"]'),
      ("blank_line", ""),  # a blank line is a record too (upstream's readlines), named
      ("bad_json", '{"image": "images/img_000.png", "conversations": ['),
      ("wrong_type", line(image=5, conversations=_turns())),
      ("wrong_type", line(image="images/img_000.png", conversations="hello")),
      ("wrong_type", line(image="images/img_000.png")),
      ("wrong_type", line(conversations=["a turn as a string", _turns()[1]])),
      ("bad_turn", line(conversations=[{"from": "human", "value": 3}, _turns()[1]])),
      ("bad_turn", '{"conversations": [{"from": "gpt", "value": "\\udc00"}]}'),
      ("no_loss_item", line(conversations=[{"from": "human", "value": "Hello?"},
                                           {"from": "human", "value": "Anyone?"}])),
      ("over_max_tokens_per_sample", line(conversations=_turns("Describe it.", long_answer))),
      ("good", line(video="videos/empty/", conversations=_turns("<video>\nWhat?"))),  # text
      ("video_unreadable", line(video="videos/junk.mp4", conversations=_turns("<video>\nWhat?"))),
      ("no_video_placeholder", line(video="videos/empty/",
                                    conversations=_turns("What happens?", "<video>"))),
      ("bad_image", line(video="videos/corrupt/", conversations=_turns("<video>\nWhat?"))),
      ("missing_file", line(video="videos/nope/", conversations=_turns("<video>\nWhat?"))),
  ]
  good = [("good", text) for text in (demo_dir / "vlm" / "sft.jsonl").read_text().splitlines()]
  rows = _interleave(good, bad)
  (data / "sft.jsonl").write_text("".join(text + "\n" for _, text in rows))
  _account(corpus, "vlm_sft", "demo_vlm", [(f"sft.jsonl:{i + 1}", r[0]) for i, r in enumerate(rows)])
  corpus.notes["vlm_sft"]["unused_images"] += 2  # the demo's rows with extra images
  corpus.notes["vlm_sft"]["unfilled_placeholders"] += 2  # ... and with extra `<image>`s


def _account(corpus: Corpus, group: str, folder: str, labelled) -> None:
  for record, label in labelled:
    record = f"{folder}/{record}"
    if label.startswith("good"):
      corpus.good[group].add(record)
    else:
      corpus.bad[group].add(record)
      corpus.expected_drops[group][label] += 1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_dir, demo_tokenizer) -> Corpus:
  root = tmp_path_factory.mktemp("bad_corpus")
  outside = root / "outside"
  (outside / "frames").mkdir(parents=True)
  (outside / "sentinel.png").write_bytes(encode(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG"))
  for n in range(1, 4):
    Image.new("RGB", (64, 64), (n, 2, 3)).save(outside / "frames" / f"frame_{n}.jpg")
  groups = ("t2i_pretrain", "unified_edit", "vlm_sft")
  c = Corpus(root, {}, {g: collections.Counter() for g in groups},
             {g: set() for g in groups}, {g: set() for g in groups},
             {g: collections.Counter() for g in groups})
  _t2i(c, demo_dir)
  _edit(c, demo_dir)
  _vlm(c, demo_dir, demo_tokenizer)
  c.dataset_info = {
      "t2i_pretrain": {"demo_t2i": {"data_dir": str(root / "t2i")}},
      "unified_edit": {"demo_edit": {"data_dir": str(root / "edit")}},
      "vlm_sft": {"demo_vlm": {"data_dir": str(root / "vlm"),
                               "jsonl_path": str(root / "vlm" / "sft.jsonl")}},
  }
  return c


def corpus_config(corpus: Corpus, demo_dir: Path, **overrides):
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw.update(dataset_info=corpus.dataset_info, tokenizer_path=str(demo_dir / "tokenizer"),
             max_decode_pixels=MAX_DECODE, num_epochs=1, **overrides)
  return config_from_dict(raw, file="bad-corpus", base_dir=str(CONFIGS))


def check_row(batch, b: int, keys) -> None:
  """A packed row is consistent: its samples, tokens and segments agree."""
  n = len(keys)
  assert batch["num_samples"][b] == n
  real = batch["token_type"][b] != 0
  assert batch["num_tokens"][b] == real.sum()
  assert batch["segment_ids"][b][real].max(initial=0) == n
  assert not batch["segment_ids"][b][~real].any() and not batch["text_ids"][b][~real].any()


def balance(stats) -> None:
  assert stats["drawn"] == (stats["packed"] + stats["dropped"] + stats["buffered"]
                            + stats["carried"])


# --- tests ------------------------------------------------------------------------------------


def test_one_epoch_counts_every_injected_record_under_its_reason(corpus, demo_dir,
                                                                  demo_tokenizer):
  cfg = corpus_config(corpus, demo_dir)
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=0))
  packed = collections.defaultdict(list)
  shapes = None
  for batch in it:
    shapes = shapes or {k: v.shape for k, v in batch.items() if hasattr(v, "shape")}
    assert {k: v.shape for k, v in batch.items() if hasattr(v, "shape")} == shapes
    for b, keys in enumerate(batch["sample_keys"]):
      if keys:
        check_row(batch, b, keys)
      for group, _, _, record in keys:
        packed[group].append(short_id(record))
    balance(pipeline_stats(it))
  stats = pipeline_stats(it)
  it.close()

  for group in corpus.good:
    assert dict(stats["drops"][group]) == dict(corpus.expected_drops[group]), group
    assert sorted(packed[group]) == sorted(corpus.good[group]), group  # each good one, once
    assert stats["counts"][group]["drawn"] == corpus.records[group]
    assert dict(stats["notes"][group]) == {k: v for k, v in corpus.notes[group].items() if v}
  assert stats["buffered"] == stats["carried"] == 0
  balance(stats)
  # Every reason the issue lists is exercised, each under its own name.
  assert set(stats["drops_by_reason"]) == {
      "bad_image", "too_many_pixels", "truncated_image", "missing_file", "path_outside_data_dir",
      "bad_json", "wrong_type", "bad_caption", "bad_edit_lists", "bad_turn", "no_loss_item",
      "over_max_tokens_per_sample", "video_unreadable", "no_video_placeholder", "blank_line"}


def test_corpus_with_workers_gives_the_same_counts_and_rows(corpus, demo_dir, demo_tokenizer):
  cfg = corpus_config(corpus, demo_dir)
  runs = []
  for workers in (0, 2):
    it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=workers))
    keys = [batch["sample_keys"] for batch in it]
    runs.append((keys, pipeline_stats(it)["drops"]))
    it.close()
  assert runs[0] == runs[1]


def test_nothing_outside_data_dir_is_opened(corpus, demo_dir, demo_tokenizer, monkeypatch):
  cfg = corpus_config(corpus, demo_dir)
  opened = []

  def recording(name):
    original = getattr(fs, name)
    def wrapper(path, *args, **kwargs):
      opened.append((name, str(path)))
      return original(path, *args, **kwargs)
    return wrapper

  for name in ("read_bytes", "open_random_access", "list_files", "exists", "is_dir"):
    monkeypatch.setattr(fs, name, recording(name))
  real_open = builtins.open
  monkeypatch.setattr(builtins, "open", lambda file, *a, **k: (
      opened.append(("open", str(file))), real_open(file, *a, **k))[1])
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=2, workers=0))
  for _ in it:
    pass
  drops = pipeline_stats(it)["drops"]["vlm_sft"]
  it.close()
  monkeypatch.undo()

  assert drops["path_outside_data_dir"] == corpus.expected_drops["vlm_sft"]["path_outside_data_dir"]
  outside = os.path.realpath(corpus.root / "outside")
  data_dirs = [os.path.realpath(corpus.root / d) for d in ("t2i", "edit", "vlm")]
  touched_outside = [(n, p) for n, p in opened if os.path.realpath(p).startswith(outside)]
  assert not touched_outside
  fs_paths = [os.path.realpath(p) for n, p in opened if n != "open"]
  assert fs_paths and all(any(p == d or p.startswith(d + os.sep) for d in data_dirs)
                          for p in fs_paths), [p for p in fs_paths if "bad_corpus" not in p]


def test_a_mostly_bad_group_stops_naming_group_file_and_reasons(tmp_path, demo_dir, demo_config,
                                                                 demo_tokenizer):
  """Over `max_bad_ratio` of the last `bad_record_window` records dropped: a clear error."""
  good = (demo_dir / "vlm" / "sft.jsonl").read_text().splitlines()
  lines = [good[i % len(good)] if i % 20 == 0 else "not json" for i in range(400)]
  (tmp_path / "sft.jsonl").write_text("\n".join(lines) + "\n")
  info = {"t2i_pretrain": {"demo_t2i": {"data_dir": str(demo_dir / "t2i")}},
          "unified_edit": {"demo_edit": {"data_dir": str(demo_dir / "edit")}},
          "vlm_sft": {"demo_vlm": {"data_dir": str(demo_dir / "vlm"),
                                   "jsonl_path": str(tmp_path / "sft.jsonl")}}}
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw.update(dataset_info=info, tokenizer_path=str(demo_dir / "tokenizer"),
             bad_record_window=50, max_bad_ratio=0.9)
  cfg = config_from_dict(raw, file="mostly-bad", base_dir=str(CONFIGS))
  it = iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0))
  with pytest.raises(GroupExhaustedError, match=r"'vlm_sft'.*bad_json.*sft\.jsonl:\d+"):
    for _ in range(200):
      next(it)
  it.close()



def _vlm_only_config(demo_dir, jsonl, **fields):
  raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
  raw["grouped_datasets"] = {"vlm_sft": raw["grouped_datasets"]["vlm_sft"]}
  raw.update(dataset_info={"vlm_sft": {"demo_vlm": {"data_dir": str(demo_dir / "vlm"),
                                                    "jsonl_path": str(jsonl)}}},
             tokenizer_path=str(demo_dir / "tokenizer"), **fields)
  return config_from_dict(raw, file="blank-lines", base_dir=str(CONFIGS))


def test_blank_lines_are_skipped_by_name_and_do_not_stop_the_group(tmp_path, demo_dir,
                                                                  demo_tokenizer):
  good = (demo_dir / "vlm" / "sft.jsonl").read_text().splitlines()[:20]
  gap = "\n" * 30 + "   \r\n"  # 31 blank lines after each record, one of spaces
  (tmp_path / "sft.jsonl").write_text("".join(line + "\n" + gap for line in good))
  cfg = _vlm_only_config(demo_dir, tmp_path / "sft.jsonl", num_epochs=1)
  with iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0)) as it:
    packed = [k for batch in it for keys in batch["sample_keys"] for k in keys]
    stats = pipeline_stats(it)
  assert len(packed) == len(good)  # every record, though 31 of each 32 lines are blank
  assert dict(stats["drops"]["vlm_sft"]) == {"blank_line": 31 * len(good)}


def test_a_file_of_blank_lines_stops_naming_them(tmp_path, demo_dir, demo_tokenizer):
  (tmp_path / "sft.jsonl").write_text("\n" * 500)
  cfg = _vlm_only_config(demo_dir, tmp_path / "sft.jsonl", max_consecutive_drops=100)
  with iter(build_pipeline(cfg, demo_tokenizer, batch_size=1, workers=0)) as it:
    with pytest.raises(GroupExhaustedError, match=r"blank_line: 100.*remove the blank lines"):
      next(it)


BOMB_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from bagel_grain.families.t2i import T2ITransform
    from bagel_grain.images import ImageError, ImageTransform, decode_image
    from bagel_grain.sources.records import Record
    sys.path.insert(0, sys.argv[1])
    from test_bad_data import BOMB

    def peak_mib():
      return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    class NoTokenizer:
      def encode(self, text):
        return np.zeros(3, np.int32)

    base = peak_mib()
    out = {}
    for cap in (89_478_485, 10**12):  # the default cap; a cap so high Pillow's own guard acts
      try:
        decode_image(BOMB, max_pixels_decode=cap)
        out[str(cap)] = "decoded"
      except ImageError as e:
        out[str(cap)] = e.reason
    t2i = T2ITransform(vae_transform=ImageTransform(512, 256, 16), group=0,
                       tokenizer=NoTokenizer(), max_decode_pixels=89_478_485)
    record = Record(0, 0, "bomb#0", 0, {"image": BOMB, "captions": '{"a": "x"}'})
    out["row"] = t2i.random_map(record, np.random.default_rng(0)).reason
    out["grown_mib"] = peak_mib() - base
    print(json.dumps(out))
""")


def test_decompression_bomb_is_refused_without_allocating_it():
  """100k x 100k RGB is 28 GiB: refused from the header, the child's peak RSS barely moves."""
  child = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
  assert child.returncode == 0, child.stderr
  out = json.loads(child.stdout.strip().splitlines()[-1])
  assert out["89478485"] == out[str(10**12)] == out["row"] == "too_many_pixels"
  assert out["grown_mib"] < 300, out
