"""VLM rows: turns split on `<image>`, files reached through the FileStore, bad rows dropped.

Rows are read from disk, and from the record the converter embeds them in: both
give the same verdict.
"""

import dataclasses
import json
import os
import resource

import numpy as np
import pytest
import yaml
from PIL import Image

from bagel_grain.config import load_config
from bagel_grain.drops import Dropped
from bagel_grain.families import video
from bagel_grain.families.files import DiskFiles
from bagel_grain.families.video import FrameSamplerArgs
from bagel_grain.families.vlm import VLMTransform, embed_files, plan_turns, plan_video_turns
from bagel_grain.images import ImageTransform, resize_size
from bagel_grain.sample import Sample
from bagel_grain.sources import framing
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.records import ConcatSource, Record, ShuffledRecords
from bagel_grain.packing.layout import Geometry, layout_sample
from bagel_grain.pipeline import family_transform
from bagel_grain.sample import SpecialTokens
from bagel_grain.tooling.convert import convert_config_file
from family_records import assert_same_outcome, shape
from hostile_images import eps_bytes, install_fake_gs, spy_decoders
from video_files import VideoSpec, decode_all, write_video
from vlm_files import png, write_vlm_files

VIT = ImageTransform(max_image_size=224, min_image_size=28, image_stride=14,
                     max_pixels=112 * 112)
FRAMES = FrameSamplerArgs(max_num_frames=5, min_num_frames=3)


def test_vlm_plans_follow_the_conversation(demo_epoch, demo_config, demo_tokenizer):
  frames = demo_config.group("vlm_sft").options.frame_sampler
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
      assert sample.notes == (("unused_images",) if placeholders < len(listed) else
                              ("unfilled_placeholders",) if placeholders > len(listed) else ())
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


def test_vlm_extra_placeholders_are_removed_and_counted(vlm, demo_tokenizer):
  sample = vlm({"image": "a.png",
                "conversations": conversation("<image>\n<image>\nCompare the two pictures.",
                                              "There is only one.")})
  assert shape(sample) == [("vit_image", 0, 0), ("text", 0, 0), ("text", 0, 1)]
  assert texts(sample, demo_tokenizer) == ["Compare the two pictures.", "There is only one."]
  assert sample.images[0].shape == (112, 112, 3)  # img_num 1: fits max_pixels
  assert sample.notes == ("unfilled_placeholders",)
  text_only = vlm({"conversations": conversation("<image>\nWhat is this?", "Nothing.")})
  assert shape(text_only) == [("text", 0, 0), ("text", 0, 1)]
  assert text_only.notes == ("unfilled_placeholders",)


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
  ("", "blank_line"),  # a blank line is a record too (upstream's readlines), named
  ("  \r", "blank_line"),
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


def test_vlm_eps_image_is_dropped_without_starting_a_process(vlm, data, tmp_path, monkeypatch):
  (data / "drawing.png").write_bytes(eps_bytes())
  log = install_fake_gs(tmp_path, monkeypatch)
  out = vlm({"image": "drawing.png", "conversations": conversation("<image>", "A line.")})
  assert isinstance(out, Dropped) and out.reason == "bad_image" and "EPS" in out.detail
  assert not log.exists()


def test_vlm_line_of_ten_thousand_images_is_dropped_undecoded(transform, tmp_path,
                                                               monkeypatch):
  calls = spy_decoders(monkeypatch)
  reads = []
  real_read = DiskFiles.read
  monkeypatch.setattr(DiskFiles, "read", lambda self, path: reads.append(path)
                      or real_read(self, path))
  line = {"image": ["a.png"] * 10_000,
          "conversations": conversation("<image>" * 10_000 + "Count them.", "Many.")}
  path = tmp_path / "rows.jsonl"
  path.write_text(json.dumps(line) + "\n")
  record = ShuffledRecords(ConcatSource([JsonlLineSource(str(path))]), seed=0)[0]
  transform.max_sample_tokens = 16384
  out = transform.random_map(record, np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "over_max_tokens_per_sample"
  assert calls == [] and reads == []
  assert transform.files_ahead(record) == [str((tmp_path / "data" / "a.png").resolve())]


def test_vlm_sample_size_from_headers_keeps_what_fits(vlm, data, transform, monkeypatch):
  (data / "wide.png").write_bytes(png((0, 0, 90), (300, 100)))
  line = {"image": ["a.png", "wide.png", "a.png"],
          "conversations": conversation("<image>Compare <image> and <image>.", "Alike.")}
  unbounded = vlm(line)
  assert isinstance(unbounded, Sample)
  assert unbounded.images[0] is unbounded.images[2]  # a file named twice is decoded once
  size = unbounded.packed_size  # counted from the decoded, resized pixels
  image_items = sum(item.type == "vit_image" for item in unbounded.plan)
  text_tokens = sum(len(t) for t in unbounded.text_ids)
  # Headers decide here: the line alone (one token per image) is far below the size.
  assert text_tokens + image_items + 2 * len(unbounded.plan) < size - 1
  transform.max_sample_tokens = size
  fits = vlm(line)
  assert isinstance(fits, Sample) and fits.packed_size == size
  calls = spy_decoders(monkeypatch)
  transform.max_sample_tokens = size - 1
  out = vlm(line)
  assert isinstance(out, Dropped) and out.reason == "over_max_tokens_per_sample"
  assert calls == []


# --- video rows: the layout upstream makes from the same frames --------------------------

LAYOUT_GEOMETRY = Geometry(vit_patch_size=14, vae_downsample=16, max_num_patch_per_side=70,
                           max_latent_size=32, interpolate_pos=False)
SPECIAL = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)
VIDEOS = (VideoSpec("h264_bframes.mp4", size=(320, 240), frames=48, keyint=12, bframes=3),
          VideoSpec("h264_odd.mkv", size=(161, 97), frames=30, keyint=7, pix_fmt="yuv444p"),
          VideoSpec("vp9.webm", codec="libvpx-vp9", size=(161, 97), frames=30, keyint=10),
          VideoSpec("short.mp4", size=(64, 48), frames=3, bframes=0))
# Upstream's middle frames for t = 5 (docs/design.md): linspace(0, 48, 6) -> 0 9 19 28 38 48,
# linspace(0, 30, 6) -> 0 6 12 18 24 30; 3 frames pad to 5 with the last.
MIDDLE_5 = {"h264_bframes.mp4": [4, 13, 23, 32, 42], "h264_odd.mkv": [2, 8, 14, 20, 26],
            "vp9.webm": [2, 8, 14, 20, 26], "short.mp4": [0, 1, 2, 2, 2]}


@pytest.fixture(scope="module")
def video_data(tmp_path_factory):
  """Video files, each frame of each saved losslessly as PNG, and frame folders."""
  data = tmp_path_factory.mktemp("video_rows")
  for spec in VIDEOS:
    write_video(data, spec)
    for i, frame in enumerate(decode_all(data / spec.name)):
      Image.fromarray(frame).save(data / f"{spec.name}.frame{i}.png")
  for name, count in (("clip48/", 48), ("clip3/", 3)):
    (data / name).mkdir()
    for i in range(count):  # frame_1 .. frame_N: name order is not N order (frame_10, frame_2)
      Image.new("RGB", (70 + i % 3, 42), (5 * i, 100, 0)).save(data / name / f"frame_{i + 1}.jpg")
  (data / "empty/").mkdir()
  return data


def video_transform(data, tokenizer, sample="middle", frames=5, **limits):
  return VLMTransform(vit_transform=VIT, data_dirs=(str(data),), group=2, tokenizer=tokenizer,
                      frame_sampler=FrameSamplerArgs(frames, frames, sample),
                      max_decode_pixels=10**7, **limits)


def row_outcome(transform, row, seed=0):
  record = Record(0, 0, "rows.jsonl:1", 0, json.dumps(row).encode())
  return transform.random_map(record, np.random.default_rng(seed))


def layout(sample):
  return layout_sample(sample.plan, sample.text_ids, sample.images, cfg_drops=(), timesteps=(),
                       geometry=LAYOUT_GEOMETRY, special=SPECIAL)


def assert_same_layout(a, b):
  for field in dataclasses.fields(a):
    x, y = getattr(a, field.name), getattr(b, field.name)
    if isinstance(x, tuple):
      assert len(x) == len(y)
      for u, v in zip(x, y):
        np.testing.assert_array_equal(u, v)
    else:
      np.testing.assert_array_equal(x, y, err_msg=field.name)


@pytest.mark.parametrize("name,frames", [*MIDDLE_5.items(), ("clip48/", [4, 13, 23, 32, 42]),
                                         ("clip3/", [0, 1, 2])])
def test_a_video_row_lays_out_as_the_image_row_of_upstreams_frames(video_data, demo_tokenizer,
                                                                   name, frames):
  """`<video>` with `sample: middle` = the row upstream builds: its frames as `<image>`s.

  The image row lists the expected frames (PNG copies of a decode from the start, or the
  folder's own files), so text ids, positions, patches, splits, labels and weights must match.
  """
  transform = video_transform(video_data, demo_tokenizer)
  ask = "What happens in <video> this clip?"
  got = row_outcome(transform, {"video": name, "conversations": conversation(ask, "It moves.")})
  if name.endswith("/"):
    listed = [f"{name}frame_{i + 1}.jpg" for i in frames]  # a folder is never padded
  else:
    listed = [f"{name}.frame{i}.png" for i in frames]
  images = "<image>" * len(frames)
  want = row_outcome(transform, {"image": listed, "conversations": conversation(
      f"What happens in {images} this clip?", "It moves.")})
  assert isinstance(got, Sample) and len(got.images) == len(frames)
  assert_same_outcome(got, want)
  assert_same_layout(layout(got), layout(want))


@pytest.mark.parametrize("sample", ["rand", "fps2"])
def test_rand_and_fps_rows_equal_the_image_row_of_their_frames(video_data, demo_tokenizer,
                                                              sample):
  transform = video_transform(video_data, demo_tokenizer, sample, frames=4)
  args = FrameSamplerArgs(4, 4, sample)
  for seed in range(3):
    got = row_outcome(transform, {"video": "h264_bframes.mp4",
                                  "conversations": conversation("<video>\nWhat?", "It moves.")},
                      seed)
    rng = np.random.default_rng(seed)
    frames = video.frame_indices(video.draw_frame_count(args, rng), 48, args, rng,
                                 input_fps=24.0)
    want = row_outcome(transform, {
        "image": [f"h264_bframes.mp4.frame{i}.png" for i in frames],
        "conversations": conversation("<image>" * len(frames) + "\nWhat?", "It moves.")})
    assert_same_outcome(got, want)
  if sample == "fps2":  # 2 s at 24 fps: the middles of 0.5 s steps (docs/design.md)
    assert frames == [6, 18, 30, 42]


def test_video_placeholders_follow_upstream(video_data, demo_tokenizer):
  transform = video_transform(video_data, demo_tokenizer, frames=3)
  clip = {"video": "clip48/"}
  # Only the first turn is searched; a `<video>` elsewhere is refused (upstream raises).
  late = row_outcome(transform, {**clip, "conversations": conversation(
      "Look.", "Ok.", "<video> What happens?", "It moves.")})
  assert isinstance(late, Dropped) and late.reason == "no_video_placeholder"
  # Every occurrence in the first turn becomes the frames; placeholders past them are ignored.
  twice = row_outcome(transform, {**clip, "conversations": conversation(
      "<video> and <video>", "Twice.")})
  assert shape(twice) == [("vit_image", 0, 0)] * 3 + [("text", 0, 0), ("text", 0, 1)]
  assert texts(twice, demo_tokenizer) == ["and", "Twice."]
  # Many `<video>`s cost one expansion, with the plan upstream's full expansion gives.
  for value in ("A <video> B <video> C", "<video>" * 10_000 + " Say.", "<video><video>x<video>"):
    turns = conversation(value, "Ok.")
    full = {**turns[0], "value": value.replace("<video>", "<image>" * 3)}
    assert plan_video_turns(turns, 3) == plan_turns([full, *turns[1:]], 3)
    assert plan_video_turns(turns, 0) == plan_turns(
        [{**turns[0], "value": value.replace("<video>", "")}, *turns[1:]], 0)
  # A row with `image` and `video` uses `image`; a video that is not a path is a bad record.
  both = row_outcome(transform, {"image": "clip48/frame_1.jpg", **clip,
                                 "conversations": conversation("<image> <video>", "One.")})
  assert len(both.images) == 1
  for value in (3, ["clip48/"], None):
    out = row_outcome(transform, {"video": value, "conversations": conversation("<video>", "?")})
    assert isinstance(out, Dropped) and out.reason == "wrong_type"


def test_an_empty_folder_gives_a_text_sample(video_data, demo_tokenizer):
  transform = video_transform(video_data, demo_tokenizer)
  out = row_outcome(transform, {"video": "empty/",
                                "conversations": conversation("<video>\nWhat?", "Nothing.")})
  assert shape(out) == [("text", 0, 0), ("text", 0, 1)] and out.images == ()
  assert texts(out, demo_tokenizer) == ["\nWhat?", "Nothing."]  # no `<image>`: kept verbatim


def test_frames_the_plan_cannot_place_are_not_decoded(video_data, demo_tokenizer, monkeypatch):
  """`<video>` in a gpt first turn: upstream samples frames that no human turn places."""
  transform = video_transform(video_data, demo_tokenizer)
  row = {"video": "h264_bframes.mp4", "conversations": [{"from": "gpt", "value": "<video> moves."}]}
  decoded = []
  monkeypatch.setattr(video._Decoder, "run", lambda self, run: decoded.append(run))
  out = row_outcome(transform, row)
  assert shape(out) == [("text", 0, 1)] and out.images == () and out.notes == ("unused_images",)
  assert texts(out, demo_tokenizer) == ["<image>" * 5 + " moves."]  # upstream's text, verbatim
  assert decoded == []


# --- video rows: bounds, on disk and in converted records ---------------------------------


def test_a_video_over_max_video_bytes_is_never_opened(video_data, demo_tokenizer):
  size = (video_data / "vp9.webm").stat().st_size
  row = {"video": "vp9.webm", "conversations": conversation("<video>", "It moves.")}
  line = json.dumps(row).encode()
  for limit, reason in ((size, None), (size - 1, "file_too_large")):
    transform = video_transform(video_data, demo_tokenizer, max_video_bytes=limit)
    converted = framing.decode(framing.encode(
        embed_files(line, str(video_data), max_video_bytes=1 << 30)))[1]
    for record in (Record(0, 0, "disk", 0, line), Record(0, 0, "ar", 0, converted)):
      out = transform.random_map(record, np.random.default_rng(0))
      assert (out.reason if isinstance(out, Dropped) else None) == reason


def test_a_video_that_is_not_a_regular_file_is_never_opened(video_data, demo_tokenizer):
  os.mkfifo(video_data / "fifo.mp4")  # opening it would wait for a writer forever
  (video_data / "folder.mp4").mkdir()
  transform = video_transform(video_data, demo_tokenizer)
  for name in ("fifo.mp4", "folder.mp4"):
    row = {"video": name, "conversations": conversation("<video>", "?")}
    out = row_outcome(transform, row)
    assert isinstance(out, Dropped) and out.reason == "not_a_regular_file"
    record = embed_files(json.dumps(row).encode(), str(video_data))
    assert record.file_errors == {name: "not_a_regular_file"} and not record.files


@pytest.mark.parametrize("name", ["h264_bframes.mp4", "vp9.webm", "short.mp4", "clip48/"])
def test_a_converted_video_row_gives_the_disk_sample(video_data, demo_tokenizer, name):
  transform = video_transform(video_data, demo_tokenizer, "rand", frames=4)
  line = json.dumps({"video": name, "conversations": conversation("<video>", "It moves.")})
  record = embed_files(line.encode(), str(video_data))
  assert (set(record.files) == {name}) != name.endswith("/")  # a file, or the folder's frames
  converted = framing.decode(framing.encode(record))[1]
  for seed in range(3):
    disk = transform.random_map(Record(0, 0, "disk", 0, line.encode()),
                                np.random.default_rng(seed))
    assert isinstance(disk, Sample) and len(disk.images) == 4
    assert_same_outcome(disk, transform.random_map(Record(0, 0, "ar", 0, converted),
                                                   np.random.default_rng(seed)))


def test_a_2_gib_video_is_refused_unread_by_the_converter_and_the_reader(tmp_path, demo_dir,
                                                                       demo_tokenizer):
  """`bagel-grain convert` and back: a sparse 2 GiB file is never read (issue 19)."""
  data = tmp_path / "data"
  data.mkdir()
  with open(data / "big.mp4", "wb") as f:
    f.truncate(2 << 30)  # sparse: no 2 GiB is written
  row = {"video": "big.mp4", "conversations": conversation("<video>", "Long.")}
  (data / "rows.jsonl").write_text(json.dumps(row) + "\n")
  config = {
      "tokenizer_path": str(demo_dir / "tokenizer"),
      "dataset_info": {"vlm_sft": {"big": {"data_dir": str(data),
                                           "jsonl_path": str(data / "rows.jsonl")}}},
      "grouped_datasets": {"vlm_sft": {
          "dataset_names": ["big"], "frame_sampler_args": {"max_num_frames": 4,
                                                           "min_num_frames": 4},
          "image_transform_args": {"image_stride": 14, "max_image_size": 490,
                                   "min_image_size": 224}}}}
  (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  done = convert_config_file(tmp_path / "config.yaml", tmp_path / "out", progress=False)
  shards = list((tmp_path / "out").rglob("*.array_record"))
  assert sum(p.stat().st_size for p in shards) < 1 << 20  # the record holds no video bytes
  for cfg in (load_config(tmp_path / "config.yaml"), load_config(done.config)):
    group = cfg.group("vlm_sft")
    record = ShuffledRecords(ConcatSource([group.family.source(group, group.datasets[0])]),
                             seed=0)[0]
    out = family_transform(cfg, 0, demo_tokenizer).random_map(record, np.random.default_rng(0))
    assert isinstance(out, Dropped) and out.reason == "file_too_large"
  grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
  assert grown_kib < 256 << 10  # far below the 2 GiB a read would take
