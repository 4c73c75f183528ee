"""VLM rows: turns split on `<image>`, files reached through the FileStore, bad rows dropped.

Rows are read from disk, and from the record the converter embeds them in: both
give the same verdict.
"""

import json

import numpy as np
import pytest

from bagel_grain.drops import Dropped
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.families.vlm import VLMTransform, embed_files
from bagel_grain.images import ImageTransform, resize_size
from bagel_grain.sample import Sample
from bagel_grain.sources import framing
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.records import ConcatSource, Record, ShuffledRecords
from family_records import assert_same_outcome, shape
from vlm_files import write_vlm_files

VIT = ImageTransform(max_image_size=224, min_image_size=28, image_stride=14,
                     max_pixels=112 * 112)
FRAMES = FrameSamplerArgs(max_num_frames=5, min_num_frames=3)


def test_vlm_plans_follow_the_conversation(demo_epoch, demo_config, demo_tokenizer):
  frames = demo_config.group("vlm_sft").frame_sampler
  kinds = set()
  for record, sample in demo_epoch("vlm_sft"):
    row = json.loads(record.fields)
    plan = shape(sample)
    assert all(cfg == 0 for _, cfg, _ in plan)
    text_items = [p for p in plan if p[0] == "text"]
    decoded = [demo_tokenizer.decode(ids) for ids in sample.text_ids]
    assert len(decoded) == len(text_items)
    loss_texts = [text for text, (_, _, loss) in zip(decoded, text_items) if loss]
    assert loss_texts == [t["value"] for t in row["conversations"] if t["from"] == "gpt"]
    vit = sum(t == "vit_image" for t, _, _ in plan)
    assert all(loss == 0 for t, _, loss in plan if t == "vit_image")
    assert vit == len(sample.images)
    if "video" in row:
      kinds.add("video")
      assert frames.min_num_frames <= vit <= frames.max_num_frames
    elif "image" in row:
      kinds.add("image")
      listed = row["image"] if isinstance(row["image"], list) else [row["image"]]
      placeholders = sum(t["value"].count("<image>") for t in row["conversations"]
                         if t["from"] == "human")
      assert vit == min(placeholders, len(listed))
      assert sample.notes == (("unused_images",) if placeholders < len(listed) else ())
    else:
      kinds.add("text")
      assert vit == 0
  assert kinds == {"video", "image", "text"}


@pytest.fixture
def data(tmp_path):
  """write_vlm_files' directory, plus an empty frame folder and a bad video."""
  data = write_vlm_files(tmp_path)
  (data / "empty_clip").mkdir()
  (data / "junk.mp4").write_bytes(b"not a video")
  return data


@pytest.fixture
def transform(data, demo_tokenizer):
  return VLMTransform(vit_transform=VIT, frame_sampler=FRAMES, data_dirs=(str(data),), group=2,
                      tokenizer=demo_tokenizer, max_decode_pixels=10**7)


@pytest.fixture
def vlm(tmp_path, transform):
  """A row (or a raw line) read from a JSONL file -> the family's output."""
  def parse(line, seed=0):
    path = tmp_path / "rows.jsonl"
    path.write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
    record = ShuffledRecords(ConcatSource([JsonlLineSource(str(path))]), seed=0)[0]
    return transform.random_map(record, np.random.default_rng(seed))

  return parse


def conversation(*turns):
  return [{"from": who, "value": value} for who, value in zip(("human", "gpt") * 3, turns)]


def texts(sample, tokenizer):
  return [tokenizer.decode(ids) for ids in sample.text_ids]


def test_vlm_extra_placeholders_are_ignored(vlm, demo_tokenizer):
  sample = vlm({"image": "a.png",
                "conversations": conversation("<image>\n<image>\nCompare the two pictures.",
                                              "There is only one.")})
  assert shape(sample) == [("vit_image", 0, 0), ("text", 0, 0), ("text", 0, 1)]
  assert texts(sample, demo_tokenizer) == ["Compare the two pictures.", "There is only one."]
  assert sample.images[0].shape == (112, 112, 3)  # img_num 1: fits max_pixels
  assert sample.notes == ()


def test_vlm_images_beyond_the_placeholders_are_never_opened(vlm):
  sample = vlm({"image": ["a.png", "corrupt.png"],
                "conversations": conversation("<image>\nDescribe the first picture.", "Red.")})
  assert isinstance(sample, Sample)  # corrupt.png was not decoded
  assert shape(sample) == [("vit_image", 0, 0), ("text", 0, 0), ("text", 0, 1)]
  assert sample.notes == ("unused_images",)
  # Both listed images count for the resize budget: max_pixels / 2 halves the area.
  assert sample.images[0].shape == (56, 56, 3)
  # The control: corrupt.png behind a placeholder is decoded and fails.
  out = vlm({"image": ["corrupt.png"], "conversations": conversation("<image>", "Red.")})
  assert isinstance(out, Dropped) and out.reason == "bad_image"


def test_vlm_image_without_placeholder_and_text_only_rows(vlm, demo_tokenizer):
  sample = vlm({"image": "a.png", "conversations": conversation(" Describe this. ", "Red.")})
  assert shape(sample) == [("text", 0, 0), ("text", 0, 1)]
  assert texts(sample, demo_tokenizer) == [" Describe this. ", "Red."]  # kept verbatim
  assert sample.images == () and sample.notes == ("unused_images",)

  sample = vlm({"conversations": conversation("What is 2 plus 2?", "4.", "And 3 plus 3?", "6.")})
  assert shape(sample) == [("text", 0, 0), ("text", 0, 1), ("text", 0, 0), ("text", 0, 1)]
  assert sample.images == () and sample.notes == ()
  assert sample.num_tokens == sum(len(ids) for ids in sample.text_ids)


def test_vlm_video_frame_folder(vlm, demo_tokenizer):
  counts = set()
  for seed in range(30):
    sample = vlm({"video": "clip/", "conversations": conversation("<video>\nWhat happens?",
                                                                  "It turns redder.")}, seed)
    n = len(sample.images)
    counts.add(n)
    assert shape(sample) == [("vit_image", 0, 0)] * n + [("text", 0, 0), ("text", 0, 1)]
    assert texts(sample, demo_tokenizer) == ["What happens?", "It turns redder."]
    # img_num = the number of frames feeds the resize budget.
    w, h = resize_size(56, 56, VIT, img_num=n)
    assert all(image.shape == (h, w, 3) for image in sample.images)
    # Frames come in N order (frame_10 after frame_9), so red never falls.
    reds = [int(image[..., 0].mean()) for image in sample.images]
    assert reds == sorted(reds) and 10 <= reds[0] and reds[-1] <= 210
  assert counts == {3, 4, 5}


def test_vlm_row_without_a_loss_item_is_dropped(vlm):
  out = vlm({"conversations": [{"from": "human", "value": "Hello?"},
                               {"from": "human", "value": "Anyone?"}]})
  assert isinstance(out, Dropped) and out.reason == "no_loss_item"


@pytest.mark.parametrize("key,path", [("image", "../outside.png"), ("image", "ABSOLUTE"),
                                      ("image", "link.png"), ("image", "clip/../../outside.png"),
                                      ("video", "../data/../")])
def test_vlm_paths_outside_data_dir_are_refused(vlm, tmp_path, key, path):
  if path == "ABSOLUTE":
    path = str(tmp_path / "outside.png")
  out = vlm({key: path, "conversations": conversation("<image>", "Green.")})
  assert isinstance(out, Dropped) and out.reason == "path_outside_data_dir"


@pytest.mark.parametrize("line,reason", [
  ({"image": "nope.png", "conversations": conversation("<image>", "?")}, "missing_file"),
  ('{"image": "a.png", "conversations": [', "bad_json"),
  ('["a", "list"]', "bad_json"),
  ("", "bad_json"),  # a blank line is a record too (upstream's readlines)
])
def test_vlm_bad_rows(vlm, line, reason):
  out = vlm(line)
  assert isinstance(out, Dropped) and out.reason == reason


# --- converted records: the same verdicts as from the disk ---------------------------


def chat(first="<image>\nWhat is it?"):
  return conversation(first, "A picture.")


@pytest.mark.parametrize("row,reason", [
  ({"image": "a.png", "conversations": chat()}, None),
  ({"image": ["a.png", "a.png", "corrupt.png"], "conversations": chat()}, None),
  ({"image": "nope.png", "conversations": chat()}, "missing_file"),
  ({"image": ["a.png", "nope.png"], "conversations": chat()}, None),  # unused, never opened
  ({"image": "corrupt.png", "conversations": chat()}, "bad_image"),
  ({"image": "link.png", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": ["a.png", "link.png"], "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "../outside.png", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "/etc/hostname", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "clip/../../outside.png", "conversations": chat()}, "path_outside_data_dir"),
  ({"image": "", "conversations": chat()}, "wrong_type"),
  ({"image": 3, "conversations": chat()}, "wrong_type"),
  ({"video": "clip/", "conversations": chat("<video>\nWhat happens?")}, None),
  ({"video": "empty_clip/", "conversations": chat("<video>\nWhat?")}, None),  # text only
  ({"video": "../data/../", "conversations": chat("<video>")}, "path_outside_data_dir"),
  ({"video": "nope.mp4", "conversations": chat("<video>")}, "missing_file"),
  ({"video": "junk.mp4", "conversations": chat("<video>")}, "video_unreadable"),
  ({"conversations": chat("Hello?")}, None),
  ('{"image": "a.png", "conversations": [', "bad_json"),
], ids=range(19))
def test_embedded_files_give_the_disk_verdict(data, transform, row, reason):
  line = (row if isinstance(row, str) else json.dumps(row)).encode()
  _, record = framing.decode(framing.encode(embed_files(line, str(data))))
  for seed in range(4):
    a = transform.random_map(Record(0, 0, "disk", 0, line), np.random.default_rng(seed))
    b = transform.random_map(Record(0, 0, "ar", 0, record), np.random.default_rng(seed))
    assert_same_outcome(a, b)
    assert (a.reason if isinstance(a, Dropped) else None) == reason


def test_embedded_video_folder_holds_its_frames_only(data):
  line = json.dumps({"video": "clip/", "conversations": chat("<video>")}).encode()
  record = embed_files(line, str(data))
  assert sorted(record.files) == sorted(f"clip/frame_{n}.jpg" for n in range(1, 11))
  assert record.file_errors == {}


def test_missing_frame_folder_is_a_missing_file(data, transform):
  line = json.dumps({"video": "gone/", "conversations": chat("<video>")}).encode()
  record = embed_files(line, str(data))
  assert record.file_errors == {"gone/": "missing_file"}
  out = transform.random_map(Record(0, 0, "ar", 0, record), np.random.default_rng(0))
  assert out.reason == "missing_file"


def test_a_path_with_a_lone_surrogate_converts_and_drops_as_on_disk(data, transform):
  line = json.dumps({"image": "a\udc00.png", "conversations": chat()}).encode()
  record = embed_files(line, str(data))
  framing.encode(record)  # no UnicodeEncodeError
  out = transform.random_map(Record(0, 0, "ar", 0, record), np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "wrong_type"
