"""Family transforms: records -> samples (plan, texts, images, num_tokens) or Dropped reasons."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bagel_grain.config import FrameSamplerArgs
from bagel_grain.families.base import Drop
from bagel_grain.families.edit import COLUMNS as EDIT_COLUMNS
from bagel_grain.families.edit import EditTransform
from bagel_grain.families.t2i import COLUMNS as T2I_COLUMNS
from bagel_grain.families.t2i import T2ITransform
from bagel_grain.families.video import sample_frame_indices
from bagel_grain.families.vlm import VLMTransform
from bagel_grain.images import ImageTransform, resize_size
from bagel_grain.pipeline import group_dataset, group_seed
from bagel_grain.drops import Dropped, DropReason
from bagel_grain.sample import Sample
from bagel_grain.sources.jsonl import JsonlLineSource
from bagel_grain.sources.parquet import ParquetRowSource, dataset_files
from bagel_grain.sources.records import ConcatSource, Record, ShuffledRecords
from vlm_files import png, write_vlm_files

T2I_PLAN = [("text", 1, 0), ("vae_image", 0, 1)]
VAE_COND, VIT_COND, TEXT_COND, VAE_LOSS = (
  ("vae_image", 1, 0), ("vit_image", 1, 0), ("text", 1, 0), ("vae_image", 0, 1))
EDIT_ONE_STEP = [VAE_COND, VIT_COND, TEXT_COND, VAE_LOSS]
EDIT_TWO_STEPS = [VAE_COND, VIT_COND, TEXT_COND, VAE_LOSS, VAE_COND, VIT_COND, TEXT_COND,
                  VAE_LOSS]
MAX_DECODE = 10_000_000


def shape(sample):
  return [(item.type, item.enable_cfg, item.loss) for item in sample.plan]




def family_dataset(cfg, name, tokenizer, *, seed):
  """A group's records in epoch order and, element for element, its family's samples."""
  index = [g.name for g in cfg.groups].index(name)
  g = cfg.groups[index]
  common = dict(group=index, tokenizer=tokenizer, max_decode_pixels=cfg.max_decode_pixels)
  if name == "vlm_sft":
    sources = [JsonlLineSource(d.jsonl_path, num_used=d.num_used_data,
                               shuffle_lines=g.shuffle_lines, shuffle_seed=g.shuffle_seed)
               for d in g.datasets]
    transform = VLMTransform(vit_transform=g.vit_transform, frame_sampler=g.frame_sampler,
                             data_dirs=tuple(d.data_dir for d in g.datasets), **common)
  else:
    columns = T2I_COLUMNS if name == "t2i_pretrain" else EDIT_COLUMNS
    sources = [ParquetRowSource(dataset_files(d.data_dir, d.num_used_data), columns)
               for d in g.datasets]
    if name == "t2i_pretrain":
      transform = T2ITransform(vae_transform=g.vae_transform, **common)
    else:
      transform = EditTransform(vae_transform=g.vae_transform, vit_transform=g.vit_transform,
                                **common)
  records = ShuffledRecords(ConcatSource(sources), seed=seed)
  return records, records.random_map(transform, seed=seed)


@pytest.fixture(scope="module")
def demo_epochs(demo_config, demo_tokenizer):
  """{group: [(record, sample)] for one epoch of the demo data}."""
  out = {}
  for g in demo_config.groups:
    records, samples = family_dataset(demo_config, g.name, demo_tokenizer, seed=11)
    out[g.name] = [(records[i], samples[i]) for i in range(records.records_per_epoch)]
  return out


def test_demo_rows_all_become_samples(demo_epochs):
  for name, pairs in demo_epochs.items():
    dropped = [s for _, s in pairs if not isinstance(s, Sample)]
    assert dropped == [], name


def test_t2i_plan_and_caption_choice(demo_epochs, demo_tokenizer):
  empty = 0
  for record, sample in demo_epochs["t2i_pretrain"]:
    assert shape(sample) == T2I_PLAN
    assert len(sample.text_ids) == 1 and len(sample.images) == 1
    captions = list(json.loads(record.fields["captions"]).values())
    text = demo_tokenizer.decode(sample.text_ids[0])
    if captions:
      assert text in captions and sample.notes == ()
    else:
      empty += 1
      assert text == " " and sample.notes == ("empty_caption",)
    assert sample.key.record == record.record_id
  assert empty == 2  # the demo writes two rows with captions `{}`


def _edit_texts(steps):
  singles = {p for step in steps for p in step}
  joined = {(a + ". ").rstrip() for a in singles} | {
    (a + ". " + b + ". ").rstrip()
    for first, second in zip(steps, steps[1:]) for a in first for b in second}
  return singles, joined


def test_edit_plans_are_upstream_chains(demo_epochs, demo_tokenizer):
  seen = set()
  for record, sample in demo_epochs["unified_edit"]:
    plan = shape(sample)
    steps = record.fields["instruction_list"]
    texts = [demo_tokenizer.decode(t) for t in sample.text_ids]
    singles, joined = _edit_texts(steps)
    assert len(sample.images) == sum(t != "text" for t, _, _ in plan)
    if plan == EDIT_ONE_STEP:
      assert texts[0] in singles | joined
    else:
      assert plan == EDIT_TWO_STEPS
      assert any(texts[0] in a and texts[1] in b for a, b in zip(steps, steps[1:]))
      # The intermediate image is both the first loss target and the next condition.
      np.testing.assert_array_equal(sample.images[2], sample.images[3])
    seen.add(len(plan))
  assert seen == {4, 8}


def test_vlm_plans_follow_the_conversation(demo_epochs, demo_config, demo_tokenizer):
  frames = demo_config.group("vlm_sft").frame_sampler
  kinds = set()
  for record, sample in demo_epochs["vlm_sft"]:
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


def test_num_tokens_and_image_geometry(demo_epochs, demo_config):
  for name, pairs in demo_epochs.items():
    g = demo_config.group(name)
    for _, sample in pairs:
      strides, limits = [], []
      for item in sample.plan:
        if item.type != "text":
          t = g.vae_transform if item.type == "vae_image" else g.vit_transform
          strides.append(t.image_stride)
          limits.append(t.max_image_size)
      assert len(sample.images) == len(strides)
      expected = sum(len(ids) for ids in sample.text_ids)
      for image, stride, limit in zip(sample.images, strides, limits):
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        h, w = image.shape[:2]
        assert h % stride == 0 and w % stride == 0 and h >= stride and w >= stride
        assert max(h, w) <= limit
        expected += h * w // stride**2
      assert all(ids.dtype == np.int32 and len(ids) > 0 for ids in sample.text_ids)
      assert sample.num_tokens == expected
      assert sample.packed_size == expected + 2 * len(sample.plan)


def _assert_same(a, b):
  assert a.key == b.key and a.plan == b.plan and a.num_tokens == b.num_tokens
  assert a.notes == b.notes
  assert len(a.text_ids) == len(b.text_ids) and len(a.images) == len(b.images)
  for x, y in zip(a.text_ids + a.images, b.text_ids + b.images):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["t2i_pretrain", "unified_edit", "vlm_sft"])
def test_same_seed_and_index_give_the_same_sample(demo_config, demo_tokenizer, name):
  _, first = family_dataset(demo_config, name, demo_tokenizer, seed=4)
  _, again = family_dataset(demo_config, name, demo_tokenizer, seed=4)
  for index in (0, 7, 29, 95):  # 95 is in a later epoch for every group
    _assert_same(first[index], again[index])
  _, other = family_dataset(demo_config, name, demo_tokenizer, seed=5)
  assert [first[i].key.record for i in range(8)] != [other[i].key.record for i in range(8)]


def test_group_dataset_is_the_family_transform_then_layout(demo_config, demo_tokenizer):
  gi = 1  # unified_edit
  prepared = group_dataset(demo_config, gi, demo_tokenizer, seed=42)
  _, samples = family_dataset(demo_config, "unified_edit", demo_tokenizer,
                              seed=group_seed(42, gi))
  for index in (0, 3, 31):
    sample = samples[index]
    assert prepared[index].key == sample.key
    assert sample.key.group == gi and sample.key.index == index
    assert prepared[index].packed_size == sample.num_tokens + 2 * len(sample.plan)


# --- T2I and edit rows written here -------------------------------------------------


VAE_64 = ImageTransform(max_image_size=64, min_image_size=32, image_stride=16)


@pytest.fixture
def t2i(demo_tokenizer):
  return T2ITransform(vae_transform=VAE_64, group=0, tokenizer=demo_tokenizer,
                      max_decode_pixels=MAX_DECODE)


def row(fields, error=None):
  return Record(index=0, epoch=0, record_id="mem.parquet#0", dataset=0, fields=fields,
                error=error)


def test_t2i_caption_choice_changes_with_the_index(tmp_path, t2i, demo_tokenizer):
  captions = {"a": "A red square.", "b": "Red everywhere.", "c": "A plain red picture."}
  pq.write_table(pa.table({"image": [png((200, 0, 0))], "captions": [json.dumps(captions)]}),
                 tmp_path / "one.parquet")
  records = ShuffledRecords(
    ConcatSource([ParquetRowSource([str(tmp_path / "one.parquet")], T2I_COLUMNS)]), seed=0)
  samples = records.random_map(t2i, seed=0)
  chosen = [demo_tokenizer.decode(samples[i].text_ids[0]) for i in range(40)]
  assert set(chosen) == set(captions.values())  # one record, many indices: all captions
  assert chosen == [demo_tokenizer.decode(samples[i].text_ids[0]) for i in range(40)]


def test_t2i_empty_caption_dict_is_an_unconditional_sample(t2i, demo_tokenizer):
  sample = t2i.random_map(row({"image": png((0, 0, 200)), "captions": "{}"}),
                          np.random.default_rng(0))
  assert shape(sample) == T2I_PLAN
  assert demo_tokenizer.decode(sample.text_ids[0]) == " "
  assert sample.notes == ("empty_caption",)
  assert sample.images[0].shape == (64, 64, 3)


@pytest.mark.parametrize("captions", ["{not json", '["a list"]', '{"a": 3}', None])
def test_t2i_bad_captions(t2i, captions):
  out = t2i.random_map(row({"image": png((0, 0, 200)), "captions": captions}),
                       np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "bad_caption"


def test_t2i_bad_image_and_unreadable_record(t2i):
  rng = np.random.default_rng(0)
  assert t2i.random_map(row({"image": b"not an image", "captions": '{"a": "x"}'}),
                        rng).reason == "bad_image"
  assert t2i.random_map(row({"image": "text", "captions": '{"a": "x"}'}),
                        rng).reason == "wrong_type"
  unreadable = Dropped(DropReason.UNREADABLE_FILE, "gone")
  out = t2i.random_map(row(None, error=unreadable), rng)
  assert (out.reason, out.detail, out.key.record) == ("unreadable_file", "gone", "mem.parquet#0")


@pytest.mark.parametrize("images,instructions", [
  (3, [["one step"]]),             # two images need two steps
  (1, []),                         # a chain needs two images
  (2, [[]]),                       # a step without a paraphrase
  (2, ["not a list of paraphrases"]),
  (2, [[3]]),
  (2, "do it"),
])
def test_edit_inconsistent_lists(demo_tokenizer, images, instructions):
  edit = EditTransform(vae_transform=VAE_64,
                       vit_transform=ImageTransform(max_image_size=56, min_image_size=28,
                                                    image_stride=14), group=1,
                       tokenizer=demo_tokenizer, max_decode_pixels=MAX_DECODE)
  fields = {"image_list": [png((10, 0, 0))] * images, "instruction_list": instructions}
  out = edit.random_map(row(fields), np.random.default_rng(0))
  assert isinstance(out, Dropped) and out.reason == "bad_edit_lists"


# --- VLM rows written here --------------------------------------------------------------

VIT = ImageTransform(max_image_size=224, min_image_size=28, image_stride=14,
                     max_pixels=112 * 112)
FRAMES = FrameSamplerArgs(max_num_frames=5, min_num_frames=3)


@pytest.fixture
def vlm(tmp_path, demo_tokenizer):
  data = write_vlm_files(tmp_path)
  transform = VLMTransform(vit_transform=VIT, frame_sampler=FRAMES, data_dirs=(str(data),),
                           group=2, tokenizer=demo_tokenizer, max_decode_pixels=MAX_DECODE)

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


# --- the frame sampler -------------------------------------------------------------------


def test_frame_indices_one_per_interval():
  counts = set()
  for seed in range(200):
    indices = sample_frame_indices(100, 8, 12, np.random.default_rng(seed))
    counts.add(len(indices))
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    assert all(0 <= i < 100 for i in indices)
  assert counts == set(range(8, 13))
  for seed in range(50):
    # 10 frames of 100: interval k is [10k, 10k + 10), upstream draws from range(10k, 10k + 9).
    indices = sample_frame_indices(100, 10, 10, np.random.default_rng(seed))
    assert all(10 * k <= i <= 10 * k + 8 for k, i in enumerate(indices))


def test_short_clip_is_padded_with_its_last_frame():
  for seed in range(10):
    assert sample_frame_indices(3, 5, 5, np.random.default_rng(seed)) == [0, 1, 2, 2, 2]
  assert sample_frame_indices(8, 8, 8, np.random.default_rng(0)) == list(range(8))


def test_a_video_without_frames_is_a_bad_record():
  with pytest.raises(Drop) as info:
    sample_frame_indices(0, 4, 6, np.random.default_rng(0))
  assert info.value.reason == "video_unreadable"


def test_too_short_intervals_fall_back_to_a_sorted_permutation():
  # 8 of 12 frames: linspace gives bounds 0,1,3,4,6,7,9,10,12, so interval [0, 0) is empty.
  seen = set()
  for seed in range(60):
    indices = sample_frame_indices(12, 8, 8, np.random.default_rng(seed))
    assert len(indices) == 8 and indices == sorted(set(indices))
    seen.update(indices)
  assert seen == set(range(12))  # per-interval draws could never pick frame 11


def test_video_folder_missing_or_with_a_frame_linking_out_is_dropped(tmp_path):
  from bagel_grain.families.files import DiskFiles
  disk = DiskFiles(str(tmp_path))
  with pytest.raises(Drop) as missing:
    disk.list_frames(str(tmp_path / "gone") + "/")
  assert missing.value.reason == "missing_file"
  clip = tmp_path / "clip"
  clip.mkdir()
  outside = tmp_path / "secret.jpg"
  outside.write_bytes(b"not read")
  (clip / "frame_1.jpg").write_bytes(b"x")
  (clip / "frame_2.jpg").symlink_to(outside)
  with pytest.raises(Drop) as escaped:
    disk.list_frames(str(clip) + "/")
  assert escaped.value.reason == "path_outside_data_dir"
