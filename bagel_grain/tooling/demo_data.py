"""A small deterministic dataset in upstream's three on-disk formats, for the demo and tests."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
import yaml
from PIL import Image, ImageDraw
from tokenizers import decoders, models, pre_tokenizers, trainers

SEED = 20250
# Qwen2 tokenizers append their special tokens after the BPE vocabulary; so do we.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>")
TOKENIZER_VOCAB_SIZE = 2000
T2I_SHARD_ROWS = (40, 36)  # the second shard ends on a short row group
T2I_ROW_GROUP_SIZE = 10
T2I_EMPTY_CAPTION_ROWS = ((0, 7), (1, 21))  # (shard, row) with captions `{}`
EDIT_ROWS = 30
EDIT_ROW_GROUP_SIZE = 8
VIDEO_FRAMES = (11, 16)  # frames per clip; upstream folders hold `*_N.jpg` frames
# VLM rows per kind; multi-image rows alternate 2 and 3 images.
VLM_SINGLE, VLM_MULTI_IMAGE, VLM_MULTI_TURN, VLM_TEXT_ONLY = 26, 8, 12, 8
VLM_IMAGES = VLM_SINGLE + VLM_MULTI_IMAGE * 5 // 2 + VLM_MULTI_TURN + 2 + 2 * 3

# An image kind is its mode plus its container; JPEG cannot hold alpha or palettes.
IMAGE_KINDS = ("rgb_jpeg", "l_jpeg", "rgb_png", "rgba_png", "p_png", "p_key_png")
KIND_WEIGHTS = (10, 2, 1, 2, 1, 2)
ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 0.5, 4.0, 0.25, 10.0, 0.1)

COLOURS = {
  "red": (214, 48, 49), "green": (39, 174, 96), "blue": (41, 98, 255),
  "yellow": (241, 196, 15), "orange": (230, 126, 34), "purple": (142, 68, 173),
  "pink": (253, 121, 168), "teal": (22, 160, 133), "white": (245, 245, 245),
  "black": (20, 20, 20), "gray": (127, 140, 141), "brown": (121, 85, 72),
}
SHAPES = ("circle", "ring", "square", "triangle", "diamond", "bar")
PLACES = {
  "top left": (0.25, 0.25), "top right": (0.75, 0.25), "center": (0.5, 0.5),
  "bottom left": (0.25, 0.75), "bottom right": (0.75, 0.75), "middle left": (0.15, 0.5),
  "middle right": (0.85, 0.5), "top middle": (0.5, 0.18), "bottom middle": (0.5, 0.82),
}
SIZES = {"small": 0.2, "medium": 0.32, "large": 0.48}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight")

# Words for the English-like filler sentences the tokenizer is also trained on.
NOUNS = ("river mountain garden window market teacher engine letter forest island kitchen "
         "painter bridge harbor library candle morning village journey station ocean pencil "
         "blanket orchard castle meadow lantern museum traveler festival machine picture "
         "question answer number pattern shadow corner surface farmer").split()
VERBS = ("carries builds finds watches paints follows opens moves holds shows crosses "
         "explains remembers measures collects describes gathers repairs discovers "
         "prefers").split()
ADJECTIVES = ("quiet bright narrow ancient gentle heavy curious golden distant simple "
              "careful silver crowded sudden patient hidden wooden smooth early "
              "famous").split()
ADVERBS = "slowly quickly carefully often rarely quietly together nearly suddenly always".split()
PREPOSITIONS = "near behind across under above beside through around beyond along".split()
FILLER_PATTERNS = (
  "The {adj} {noun} {verb} the {noun2} {prep} the {noun3}.",
  "{name} {adv} {verb} a {adj} {noun}.",
  "In the {adj} {noun}, {name} {verb} {count} {noun2}s.",
  "Every {noun} {adv} {verb} something {adj}, said {name}.",
)
SYLLABLES = ("ka lo mi ren tor vel sa qui bran dor fe lix mo nar pe ru sil ta ven zo "
             "gra thu el an").split()


@dataclasses.dataclass(frozen=True)
class Shape:
  kind: str
  colour: str
  place: str
  size: str


@dataclasses.dataclass(frozen=True)
class Scene:
  """What an image shows; captions and answers are written from it, so they are true."""

  start: str  # gradient colours
  end: str
  angle: float
  shapes: tuple[Shape, ...]


# --- scenes and their texts ---------------------------------------------------------


def _random_shape(r: random.Random) -> Shape:
  return Shape(r.choice(SHAPES), r.choice(list(COLOURS)), r.choice(list(PLACES)),
               r.choice(list(SIZES)))


def _random_scene(r: random.Random, min_shapes: int = 1, max_shapes: int = 4) -> Scene:
  start, end = r.sample(list(COLOURS), 2)
  shapes = tuple(_random_shape(r) for _ in range(r.randint(min_shapes, max_shapes)))
  return Scene(start, end, r.uniform(0, 2 * math.pi), shapes)


def _shape_phrase(s: Shape, with_size: bool = True) -> str:
  size = f"{s.size} " if with_size else ""
  return f"a {size}{s.colour} {s.kind} in the {s.place}"


def _join(phrases: list[str]) -> str:
  if len(phrases) == 1:
    return phrases[0]
  return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _number(n: int) -> str:
  return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)


def _invented_name(r: random.Random) -> str:
  return "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 3))).capitalize()


def _describe(scene: Scene) -> str:
  return _join([_shape_phrase(s) for s in scene.shapes])


def _captions(r: random.Random, scene: Scene) -> list[str]:
  n = len(scene.shapes)
  plural = "shape" if n == 1 else "shapes"
  options = [
    f"{_describe(scene).capitalize()} on a {scene.start} to {scene.end} gradient.",
    f"{_number(n).capitalize()} {plural} over a {scene.start} and {scene.end} "
    f"background: {_join([_shape_phrase(s, False) for s in scene.shapes])}.",
    f"An abstract picture titled {_invented_name(r)}, showing {_describe(scene)}.",
    f"Flat illustration, {scene.start} fading into {scene.end}, with {_describe(scene)}.",
  ]
  return r.sample(options, r.randint(1, 3))


def _instructions(r: random.Random, s: Shape) -> list[str]:
  options = [
    f"Add a {s.size} {s.colour} {s.kind} in the {s.place}.",
    f"Put a {s.colour} {s.kind} at the {s.place}.",
    f"Draw a {s.size} {s.colour} {s.kind} near the {s.place} of the picture.",
    f"Place one {s.colour} {s.kind} in the {s.place} and keep everything else.",
  ]
  return r.sample(options, r.randint(1, 3))


def filler_sentence(r: random.Random) -> str:
  words = {"noun": r.choice(NOUNS), "noun2": r.choice(NOUNS), "noun3": r.choice(NOUNS),
           "adj": r.choice(ADJECTIVES), "verb": r.choice(VERBS), "adv": r.choice(ADVERBS),
           "prep": r.choice(PREPOSITIONS), "name": _invented_name(r), "count": r.randint(2, 999)}
  return r.choice(FILLER_PATTERNS).format(**words)


def _tokenizer_corpus() -> list[str]:
  r = random.Random(f"{SEED}-corpus")
  texts = [filler_sentence(r) for _ in range(600)]
  for _ in range(150):
    scene = _random_scene(r)
    texts += _captions(r, scene)
    texts += _instructions(r, _random_shape(r))
  return texts


# --- images -------------------------------------------------------------------------


def _spread(r: random.Random, n: int, values, weights) -> list:
  """`n` draws that contain every value at least once (so tests can rely on each)."""
  out = list(values) + r.choices(values, weights=weights, k=n - len(values))
  r.shuffle(out)
  return out


def _size(r: random.Random, aspect: float, lo: int, hi: int) -> tuple[int, int]:
  ratio = max(aspect, 1 / aspect)
  long = r.randint(min(hi, max(lo, math.ceil(64 * ratio))), hi)  # extreme shapes stay extreme
  short = max(64, round(long / ratio))
  return (long, short) if aspect >= 1 else (short, long)


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape, w: int, h: int) -> None:
  cx, cy = PLACES[s.place][0] * w, PLACES[s.place][1] * h
  rad = max(3.0, SIZES[s.size] * min(w, h) / 2)
  fill = COLOURS[s.colour]
  box = (cx - rad, cy - rad, cx + rad, cy + rad)
  if s.kind == "circle":
    draw.ellipse(box, fill=fill)
  elif s.kind == "ring":
    draw.ellipse(box, outline=fill, width=max(2, int(rad / 4)))
  elif s.kind == "square":
    draw.rectangle(box, fill=fill)
  elif s.kind == "triangle":
    draw.polygon([(cx, cy - rad), (cx + rad, cy + rad), (cx - rad, cy + rad)], fill=fill)
  elif s.kind == "diamond":
    draw.polygon([(cx, cy - rad), (cx + rad, cy), (cx, cy + rad), (cx - rad, cy)], fill=fill)
  else:  # bar
    draw.rectangle((cx - rad, cy - rad / 4, cx + rad, cy + rad / 4), fill=fill)


def _render(scene: Scene, size: tuple[int, int], noise: np.random.Generator | None,
            moving: tuple[Shape, float, float] | None = None) -> Image.Image:
  """RGB gradient plus shapes; `noise` adds mild grain (JPEG only: PNG grows with it)."""
  w, h = size
  t = (math.cos(scene.angle) * np.linspace(0, 1, w, dtype=np.float32)[None, :]
       + math.sin(scene.angle) * np.linspace(0, 1, h, dtype=np.float32)[:, None])
  t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
  c0 = np.asarray(COLOURS[scene.start], np.float32)
  c1 = np.asarray(COLOURS[scene.end], np.float32)
  arr = c0 + (c1 - c0) * t[..., None]
  if noise is not None:
    arr = arr + noise.normal(0.0, 5.0, (h, w, 1)).astype(np.float32)
  img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
  draw = ImageDraw.Draw(img)
  for s in scene.shapes:
    _draw_shape(draw, s, w, h)
  if moving is not None:  # a video frame: one shape at a fractional position
    s, fx, fy = moving
    rad = SIZES[s.size] * min(w, h) / 2
    draw.ellipse((fx * w - rad, fy * h - rad, fx * w + rad, fy * h + rad), fill=COLOURS[s.colour])
  return img


def _encode(img: Image.Image, kind: str) -> bytes:
  """Encodes an RGB render as `kind` (see IMAGE_KINDS)."""
  buf = io.BytesIO()
  if kind == "rgb_jpeg":
    img.save(buf, "JPEG", quality=88)
  elif kind == "l_jpeg":
    img.convert("L").save(buf, "JPEG", quality=88)
  elif kind == "rgb_png":
    img.save(buf, "PNG")
  elif kind == "rgba_png":
    # Partial alpha: a ramp from 40 to 255 across the width.
    alpha = np.linspace(40, 255, img.width, dtype=np.float32)
    alpha = np.broadcast_to(alpha.astype(np.uint8)[None, :], (img.height, img.width))
    rgba = img.copy()
    rgba.putalpha(Image.fromarray(np.ascontiguousarray(alpha), "L"))
    rgba.save(buf, "PNG")
  elif kind == "p_png":
    img.quantize(colors=32).save(buf, "PNG")
  elif kind == "p_key_png":
    pal = img.quantize(colors=32)
    # The top-left corner's colour becomes transparent (a background key).
    pal.save(buf, "PNG", transparency=pal.getpixel((0, 0)))
  else:
    raise ValueError(f"unknown image kind {kind!r}; expected one of {IMAGE_KINDS}")
  return buf.getvalue()


def _image_bytes(scene: Scene, size: tuple[int, int], kind: str,
                 noise: np.random.Generator) -> bytes:
  return _encode(_render(scene, size, noise if kind.endswith("jpeg") else None), kind)


def _extension(kind: str) -> str:
  return ".jpg" if kind.endswith("jpeg") else ".png"


# --- writers ------------------------------------------------------------------------


def write_tokenizer(out: Path) -> None:
  """A byte-level BPE trained here, so nothing is downloaded."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_tokenizer_corpus(), trainer)
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in SPECIAL_TOKENS])
  out.mkdir(parents=True, exist_ok=True)
  tok.save(str(out / "tokenizer.json"), pretty=True)
  # Lets transformers.AutoTokenizer load the directory as a plain fast tokenizer.
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_t2i(out: Path) -> int:
  r = random.Random(f"{SEED}-t2i")
  noise = np.random.default_rng([SEED, 1])
  n = sum(T2I_SHARD_ROWS)
  kinds = _spread(r, n, IMAGE_KINDS, KIND_WEIGHTS)
  aspects = _spread(r, n, ASPECTS, [1] * len(ASPECTS))
  out.mkdir(parents=True, exist_ok=True)
  i = 0
  for shard, rows in enumerate(T2I_SHARD_ROWS):
    images, captions = [], []
    for row in range(rows):
      scene = _random_scene(r)
      images.append(_image_bytes(scene, _size(r, aspects[i], 64, 640), kinds[i], noise))
      texts = [] if (shard, row) in T2I_EMPTY_CAPTION_ROWS else _captions(r, scene)
      captions.append(json.dumps({f"caption_{k}": c for k, c in enumerate(texts)}))
      i += 1
    table = pa.table({"image": pa.array(images, pa.binary()),
                      "captions": pa.array(captions, pa.string())})
    pq.write_table(table, out / f"part-{shard:05d}.parquet", row_group_size=T2I_ROW_GROUP_SIZE)
  return n


def _write_edit(out: Path, root: Path) -> int:
  """Each chain adds one shape per step, so every instruction describes its edit."""
  r = random.Random(f"{SEED}-edit")
  noise = np.random.default_rng([SEED, 2])
  kinds = _spread(r, EDIT_ROWS, IMAGE_KINDS, (20, 1, 1, 1, 1, 1))
  lengths = _spread(r, EDIT_ROWS, (2, 3, 4, 5), (1, 1, 1, 1))
  image_lists, instruction_lists = [], []
  for row in range(EDIT_ROWS):
    scene = _random_scene(r, 1, 2)
    size = _size(r, r.choice(ASPECTS), 64, 448)
    images, steps = [_image_bytes(scene, size, kinds[row], noise)], []
    for _ in range(lengths[row] - 1):
      shape = _random_shape(r)
      scene = dataclasses.replace(scene, shapes=scene.shapes + (shape,))
      images.append(_image_bytes(scene, size, kinds[row], noise))
      steps.append(_instructions(r, shape))
    image_lists.append(images)
    instruction_lists.append(steps)
  table = pa.table({"image_list": pa.array(image_lists, pa.list_(pa.binary())),
                    "instruction_list": pa.array(instruction_lists,
                                                 pa.list_(pa.list_(pa.string())))})
  out.mkdir(parents=True, exist_ok=True)
  path = out / "part-00000.parquet"
  pq.write_table(table, path, row_group_size=EDIT_ROW_GROUP_SIZE)
  meta = pq.read_metadata(path)
  info = {path.relative_to(root).as_posix(): {"num_row_groups": meta.num_row_groups,
                                              "num_rows": meta.num_rows}}
  (out / "parquet_info.json").write_text(json.dumps(info, indent=2) + "\n")
  return EDIT_ROWS


def _turn(who: str, value: str) -> dict[str, str]:
  return {"from": who, "value": value}


class _VlmImages:
  """Writes the VLM images one by one, each with the scene it shows."""

  def __init__(self, data_dir: Path, r: random.Random):
    self.data_dir, self.r, self.count = data_dir, r, 0
    self.noise = np.random.default_rng([SEED, 3])
    self.kinds = _spread(r, VLM_IMAGES, IMAGE_KINDS, KIND_WEIGHTS)
    (data_dir / "images").mkdir(parents=True, exist_ok=True)

  def new(self) -> tuple[str, Scene]:
    kind = self.kinds[self.count]
    scene = _random_scene(self.r)
    rel = f"images/img_{self.count:03d}{_extension(kind)}"
    size = _size(self.r, self.r.choice(ASPECTS), 64, 640)
    (self.data_dir / rel).write_bytes(_image_bytes(scene, size, kind, self.noise))
    self.count += 1
    return rel, scene


def _count_answer(scene: Scene) -> str:
  n = len(scene.shapes)
  return f"There {'is' if n == 1 else 'are'} {_number(n)} {'shape' if n == 1 else 'shapes'}."


def _write_video(data_dir: Path, clip: int, frames: int, r: random.Random) -> tuple[str, str]:
  """A folder of frames `frame_1.jpg`..`frame_N.jpg`: one shape crossing the picture."""
  rel = f"videos/clip{clip}/"
  folder = data_dir / rel
  folder.mkdir(parents=True, exist_ok=True)
  scene = _random_scene(r, 1, 1)
  mover = _random_shape(r)
  horizontal = clip % 2 == 0
  size = (160, 96) if horizontal else (96, 128)
  for f in range(frames):
    p = 0.15 + 0.7 * f / (frames - 1)
    pos = (p, 0.5) if horizontal else (0.5, p)
    frame = _render(scene, size, None, (mover, *pos))
    frame.save(folder / f"frame_{f + 1}.jpg", "JPEG", quality=88)
  path = "from the left to the right" if horizontal else "from the top down to the bottom"
  return rel, f"A {mover.colour} circle moves {path}."


def _write_vlm(data_dir: Path) -> int:
  r = random.Random(f"{SEED}-vlm")
  images = _VlmImages(data_dir, r)
  rows: list[dict] = []
  questions = ("What shapes are in this picture?", "Describe the image.",
               "List the shapes you can see and where they are.")
  for i in range(VLM_SINGLE):
    rel, scene = images.new()
    q = r.choice(questions)
    human = f"<image>\n{q}" if i % 3 else f"{q}\n<image>"
    rows.append({"id": f"single_{i}", "image": rel,
                 "conversations": [_turn("human", human),
                                   _turn("gpt", f"{_describe(scene).capitalize()}.")]})
  for i in range(VLM_MULTI_IMAGE):
    pics = [images.new() for _ in range(2 + i % 2)]
    human = "".join(f"Picture {k + 1}: <image>\n" for k in range(len(pics)))
    total = sum(len(s.shapes) for _, s in pics)
    rows.append({"id": f"multi_image_{i}", "image": [p for p, _ in pics],
                 "conversations": [_turn("human", human + "How many shapes are there in total?"),
                                   _turn("gpt", f"{_number(total).capitalize()} shapes "
                                                f"across the {len(pics)} pictures.")]})
  for i in range(VLM_MULTI_TURN):
    rel, scene = images.new()
    convs = [_turn("human", "<image>\nDescribe the image."),
             _turn("gpt", f"{_describe(scene).capitalize()}."),
             _turn("human", "Which colours does the background have?"),
             _turn("gpt", f"It fades from {scene.start} to {scene.end}.")]
    if i % 2:
      convs += [_turn("human", "How many shapes are there?"), _turn("gpt", _count_answer(scene))]
    rows.append({"id": f"multi_turn_{i}", "image": rel, "conversations": convs})
  for i in range(2):  # upstream ignores the extra placeholder
    rel, scene = images.new()
    rows.append({"id": f"extra_placeholders_{i}", "image": rel,
                 "conversations": [_turn("human", "<image>\n<image>\nCompare the two pictures."),
                                   _turn("gpt", "There is only one picture: "
                                                f"{_describe(scene)}.")]})
  for i in range(2):  # upstream never packs the images beyond the placeholders
    pics = [images.new() for _ in range(3)]
    rows.append({"id": f"extra_images_{i}", "image": [p for p, _ in pics],
                 "conversations": [_turn("human", "<image>\nDescribe the first picture."),
                                   _turn("gpt", f"{_describe(pics[0][1]).capitalize()}.")]})
  for i in range(VLM_TEXT_ONLY):
    a, b = r.randint(2, 99), r.randint(2, 99)
    noun = r.choice(NOUNS)
    prompts = [(f"What is {a} plus {b}?", f"{a + b}."),
               (f"Spell the word {noun} backwards.", noun[::-1] + "."),
               (f"Write one sentence about a {noun}.", filler_sentence(r))]
    q, ans = prompts[i % len(prompts)]
    rows.append({"id": f"text_only_{i}",
                 "conversations": [_turn("human", q), _turn("gpt", ans)]})
  for clip, frames in enumerate(VIDEO_FRAMES):
    rel, answer = _write_video(data_dir, clip, frames, r)
    rows.append({"id": f"video_{clip}", "video": rel,
                 "conversations": [_turn("human", "<video>\nWhat happens in this clip?"),
                                   _turn("gpt", answer)]})
  r.shuffle(rows)
  text = "".join(json.dumps(row) + "\n" for row in rows)
  (data_dir / "sft.jsonl").write_bytes(text.encode())
  return len(rows)


VIDEO_DEMO_CONFIG = "video_demo.yaml"
VIDEO_DEMO_FILE_FRAMES = 36  # the H.264 clip: 3 s at 12 fps, a keyframe every 12 frames
VIDEO_DEMO_FOLDER_FRAMES = 9


def _moving_frames(r: random.Random, frames: int, size: tuple[int, int]):
  """A shape crossing a gradient, as RGB images, and the sentence that says so."""
  scene, mover = _random_scene(r, 1, 1), _random_shape(r)
  images = [_render(scene, size, None, (mover, 0.15 + 0.7 * f / (frames - 1), 0.5))
            for f in range(frames)]
  return images, f"A {mover.colour} circle moves from the left to the right."


def _write_mp4(path: Path, images: list[Image.Image], rate: int) -> None:
  """H.264 with B-frames; `mbtree=0` and `+bitexact` make the bytes the same on every run."""
  import av  # pylint: disable=import-outside-toplevel

  with av.open(str(path), "w", options={"fflags": "+bitexact"}) as out:
    stream = out.add_stream("libx264", rate=rate)
    stream.width, stream.height = images[0].size
    stream.pix_fmt = "yuv420p"
    stream.options = {"g": "12", "bf": "2", "mbtree": "0", "sc_threshold": "0",
                      "preset": "veryfast", "threads": "1"}
    for image in images:
      out.mux(stream.encode(av.VideoFrame.from_image(image)))
    out.mux(stream.encode())


def _write_video_demo(root: Path) -> int:
  """`video/`: one short H.264 file and one frame folder, with their own JSONL and config.

  Apart from `vlm/`, so the demo config's stream (pinned by tests) is unchanged;
  `video_demo.yaml` packs these rows alone (`make demo` runs it after the main demo).
  """
  data_dir = root / "video"
  r = random.Random(f"{SEED}-video")
  (data_dir / "clips").mkdir(parents=True, exist_ok=True)
  images, file_answer = _moving_frames(r, VIDEO_DEMO_FILE_FRAMES, (160, 96))
  _write_mp4(data_dir / "clips" / "clip.mp4", images, rate=12)
  folder = data_dir / "frames" / "clip"
  folder.mkdir(parents=True, exist_ok=True)
  images, folder_answer = _moving_frames(r, VIDEO_DEMO_FOLDER_FRAMES, (96, 128))
  for f, image in enumerate(images):
    image.save(folder / f"frame_{f + 1}.jpg", "JPEG", quality=88)
  rows = []
  for video, answer in (("clips/clip.mp4", file_answer), ("frames/clip/", folder_answer)):
    for q in ("<video>\nWhat happens in this clip?", "Describe the motion. <video>"):
      rows.append({"id": f"video_{len(rows)}", "video": video,
                   "conversations": [_turn("human", q), _turn("gpt", answer)]})
  (data_dir / "video.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
  config = {
      "tokenizer_path": "tokenizer", "dataset_info": "dataset_info.yaml",
      "grouped_datasets": {"vlm_sft": {
          "dataset_names": ["demo_video"],
          "image_transform_args": {"image_stride": 14, "max_image_size": 490,
                                   "min_image_size": 224},
          "frame_sampler_args": {"max_num_frames": 8, "min_num_frames": 4, "sample": "middle"},
          "weight": 1}},
      "expected_num_tokens": 4096, "max_num_tokens": 5120, "max_num_tokens_per_sample": 4096,
      "prefer_buffer_before": 2048, "max_buffer_size": 4, "vit_patch_size": 14,
      "max_num_patch_per_side": 70, "data_seed": 42, "batch_size": 1}
  header = ("# The demo's video rows (a video file and a frame folder) alone; paths are\n"
            "# relative to this file. `bagel-grain demo --config <this file>`.\n")
  (root / VIDEO_DEMO_CONFIG).write_text(header + yaml.safe_dump(config, sort_keys=False))
  return len(rows)


def make_sample_data(out_dir: str | Path) -> Path:
  """Writes the demo dataset (same bytes on every run on one machine); returns its root.

  Layout: `tokenizer/`, `t2i/`, `edit/`, `vlm/`, `video/` (with `video_demo.yaml`, its
  config), `dataset_info.yaml` and, last, the `.complete` marker the Makefile waits for.
  """
  root = Path(out_dir)
  root.mkdir(parents=True, exist_ok=True)
  marker = root / ".complete"
  marker.unlink(missing_ok=True)
  write_tokenizer(root / "tokenizer")
  n_t2i = _write_t2i(root / "t2i")
  n_edit = _write_edit(root / "edit", root)
  n_vlm = _write_vlm(root / "vlm")
  n_video = _write_video_demo(root)
  info = {
    "t2i_pretrain": {"demo_t2i": {"data_dir": "t2i", "num_files": len(T2I_SHARD_ROWS),
                                  "num_total_samples": n_t2i}},
    "unified_edit": {"demo_edit": {"data_dir": "edit",
                                   "parquet_info_path": "edit/parquet_info.json",
                                   "num_files": 1, "num_total_samples": n_edit}},
    "vlm_sft": {"demo_vlm": {"data_dir": "vlm", "jsonl_path": "vlm/sft.jsonl",
                             "num_total_samples": n_vlm},
                "demo_video": {"data_dir": "video", "jsonl_path": "video/video.jsonl",
                               "num_total_samples": n_video}},
  }
  header = "# Demo datasets in upstream's dataset_info format; paths are relative to this file.\n"
  (root / "dataset_info.yaml").write_text(header + yaml.safe_dump(info, sort_keys=False))
  marker.write_text("")
  return root


if __name__ == "__main__":
  print(make_sample_data(sys.argv[1] if len(sys.argv) > 1 else ".demo_data"))
