"""VLM SFT rows (JSONL + image files, video frames) -> interleaved ViT images and text turns."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from bagel_grain import fs
from bagel_grain.config_values import check_keys, number
from bagel_grain.drops import FILE_REASONS, IMAGE_REASONS, RECORD_REASONS, VIDEO_REASONS
from bagel_grain.drops import Drop, DropReason, Note, require
from bagel_grain.errors import ConfigError
from bagel_grain.families import video
from bagel_grain.families.base import FamilyTransform, is_text
from bagel_grain.families.family import Family, GroupOptions
from bagel_grain.families.files import (DiskFiles, EmbeddedFiles, FileStore, is_folder,
                                        opened_video)
from bagel_grain.families.video import DEFAULT_MAX_VIDEO_BYTES, FrameSamplerArgs
from bagel_grain.images import ImageTransform, image_size, resize_image, resize_size
from bagel_grain.ranged_file import VideoHead
from bagel_grain.sample import PlanItem, Sample
from bagel_grain.sources.framing import LineWithFiles
from bagel_grain.sources.records import Record

if TYPE_CHECKING:
  from bagel_grain.config import GroupConfig

IMAGE = PlanItem("vit_image", enable_cfg=0, loss=0)
PROMPT = PlanItem("text", enable_cfg=0, loss=0)
ANSWER = PlanItem("text", enable_cfg=0, loss=1)


def parse_row(line: bytes) -> dict:
  """The JSON object of a line; Drop(blank_line) for an empty line, Drop(bad_json) for
  anything else."""
  if not line.strip():
    raise Drop(DropReason.BLANK_LINE, "an empty line")
  try:
    row = json.loads(line)
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise Drop(DropReason.BAD_JSON, str(e)) from None
  require(isinstance(row, dict), DropReason.BAD_JSON, "line is not a JSON object")
  return row


def listed_images(row: dict) -> list[Any]:
  """The row's `image` entry as a list (upstream allows one path or a list)."""
  return row["image"] if isinstance(row["image"], list) else [row["image"]]


def plan_turns(conversations, num_images: int) -> tuple[list[PlanItem], list[str]]:
  """Plan items and texts of the turns; an image item per `<image>` while images remain."""
  plan, texts, _ = placed_turns(conversations, num_images)
  return plan, texts


def placed_turns(conversations, num_images: int) -> tuple[list[PlanItem], list[str], int]:
  """`plan_turns`, and how many `<image>` placeholders found no image (removed, as upstream
  removes them)."""
  require(isinstance(conversations, list), DropReason.WRONG_TYPE, "conversations is not a list")
  plan, texts, images_left, unfilled = [], [], num_images, 0
  for turn in conversations:
    require(isinstance(turn, dict), DropReason.WRONG_TYPE, "a turn is not an object")
    role, value = turn.get("from"), turn.get("value")
    require(is_text(value), DropReason.BAD_TURN, "a turn's value is not UTF-8 text")
    if role == "human":
      if "<image>" not in value:
        plan.append(PROMPT)  # upstream keeps such a turn verbatim (not stripped)
        texts.append(value)
        continue
      pieces = value.split("<image>")
      for i, piece in enumerate(pieces):
        if piece.strip():
          plan.append(PROMPT)
          texts.append(piece.strip())
        if i < len(pieces) - 1:
          if images_left > 0:
            plan.append(IMAGE)
            images_left -= 1
          else:  # extra placeholders are removed from the text, as upstream does
            unfilled += 1
    elif role == "gpt":
      plan.append(ANSWER)
      texts.append(value)
  return plan, texts, unfilled


def _located(files: FileStore, listed: list[Any]) -> list[str]:
  """Each listed path located; a path listed many times is located (resolved) once."""
  located: dict[str, str] = {}
  out = []
  for relative in listed:
    if isinstance(relative, str) and relative in located:
      out.append(located[relative])
      continue
    out.append(files.locate(relative))  # raises Drop for anything but a usable path
    located[relative] = out[-1]
  return out


class VLMTransform(FamilyTransform):
  """BAGEL's SFT parsing: human text split on `<image>`, gpt turns carry the loss.

  `img_num` (the resize's `max_pixels / img_num`) counts every image the row
  lists; images beyond the placeholders are neither decoded nor packed.
  """

  def __init__(self, *, vit_transform: ImageTransform, frame_sampler: FrameSamplerArgs,
               data_dirs: tuple[str, ...], **kwargs):
    super().__init__(**kwargs)
    self.vit_transform = vit_transform
    self.frame_sampler = frame_sampler
    self.data_dirs = data_dirs

  def _line_and_files(self, record: Record) -> tuple[bytes, FileStore]:
    if isinstance(record.fields, LineWithFiles):  # a converted record: its files travel with it
      return record.fields.line, EmbeddedFiles(record.fields)
    return record.fields, DiskFiles(self.data_dirs[record.dataset], self.read_ahead,
                                    self.max_image_bytes)

  def files_ahead(self, record: Record) -> list[str | VideoHead]:
    """The image files a line lists, or its frame folder (listed ahead; which frames are read
    is drawn when parsed), or its video object's head (`ranged_file.VideoHead`; a local
    video file is opened when parsed)."""
    if record.error is not None or isinstance(record.fields, LineWithFiles):
      return []
    try:
      row = parse_row(record.fields)
      video = row.get("video")
      images = "image" in row
      listed = listed_images(row) if images else [video] if isinstance(video, str) else []
    except Drop:
      return []
    disk, paths = DiskFiles(self.data_dirs[record.dataset]), []
    for relative in {p: None for p in listed if isinstance(p, str)}:  # each path once
      try:
        located = disk.locate(relative)
      except Drop:
        continue  # refused again, and counted, when parsed
      if images or is_folder(located):
        paths.append(located)
      elif fs.is_uri(located):  # a video object: its size and first bytes
        paths.append(VideoHead(located))
    return list(dict.fromkeys(paths))  # names of one file: read once

  def _video_frames(self, files: FileStore, path: str, rng: np.random.Generator,
                    used: Callable[[int], int]) -> tuple[list, int]:
    """The first `used(n)` of the `n` frames a video gives, and `n`: paths of a frame
    folder's entries, or frames decoded from a video file (PIL images)."""
    if is_folder(path):
      frames = video.sample_folder(files.list_frames(path, self.max_video_frames),
                                   self.frame_sampler, rng,
                                   max_frames=self.max_video_frames)
      return frames[:used(len(frames))], len(frames)
    with opened_video(files, path, self.max_video_bytes) as source:
      return video.read_video_frames(
          source, self.frame_sampler, rng, max_frames=self.max_video_frames,
          max_pixels=self.max_decode_pixels, take=used)

  def _frame_pixels(self, files: FileStore, frames: list, num_frames: int) -> list[np.ndarray]:
    pixels = []
    with files.reading(f for f in frames if isinstance(f, str)):
      for frame in frames:
        if isinstance(frame, str):  # an entry of a frame folder
          pixels.extend(self.load(files.read(frame), [(self.vit_transform, num_frames)]))
        else:  # a frame decoded from a video file
          pixels.append(resize_image(frame, self.vit_transform, num_frames))
    return pixels

  def parse(self, record: Record, rng: np.random.Generator) -> Sample:
    line, files = self._line_and_files(record)
    row = parse_row(line)
    conversations = row.get("conversations")
    require(isinstance(conversations, list), DropReason.WRONG_TYPE,
            "conversations missing or not a list")
    notes: tuple[str, ...] = ()
    if "image" in row:  # a row with both uses `image`, as upstream
      images = _located(files, listed_images(row))
      plan, texts, unfilled = placed_turns(conversations, len(images))
      require(any(item.loss for item in plan), DropReason.NO_LOSS_ITEM)
      self.check_text_length(texts)
      used = sum(item.type == "vit_image" for item in plan)
      notes = ((Note.UNUSED_IMAGES,) if used < len(images) else
               (Note.UNFILLED_PLACEHOLDERS,) if unfilled else ())
      text_ids = tuple(self.tokenize(texts))
      pixels = self._image_pixels(files, images[:used], len(images), plan, text_ids)
    elif "video" in row:
      path = files.locate(row["video"])
      require(conversations, DropReason.NO_LOSS_ITEM)
      video_turn(conversations[0])

      def used(num_frames: int) -> int:  # frames the plan places; only those are decoded
        plan, _ = plan_video_turns(conversations, num_frames)
        return sum(item.type == "vit_image" for item in plan)

      frames, num_frames = self._video_frames(files, path, rng, used)
      plan, texts = plan_video_turns(conversations, num_frames)
      require(any(item.loss for item in plan), DropReason.NO_LOSS_ITEM)
      self.check_text_length(texts)
      notes = (Note.UNUSED_IMAGES,) if len(frames) < num_frames else ()
      text_ids = tuple(self.tokenize(texts))
      pixels = self._frame_pixels(files, frames, num_frames)
    else:
      plan, texts, unfilled = placed_turns(conversations, 0)
      require(any(item.loss for item in plan), DropReason.NO_LOSS_ITEM)
      notes = (Note.UNFILLED_PLACEHOLDERS,) if unfilled else ()
      self.check_text_length(texts)
      text_ids = tuple(self.tokenize(texts))
      pixels = []
    num_tokens = sum(len(t) for t in text_ids) + sum(
        self.image_tokens(p, self.vit_transform.image_stride) for p in pixels)
    return Sample(tuple(plan), text_ids, tuple(pixels), num_tokens, self.key(record), notes)

  def _image_pixels(self, files: FileStore, images: list[str], img_num: int, plan: list,
                    text_ids: tuple) -> list[np.ndarray]:
    """The placed images' pixels, once the sample's size is known to fit: first from the
    line alone (each image at least one token), then from the images' headers; a file
    named many times is decoded once."""
    text_tokens = sum(len(t) for t in text_ids)
    self.check_sample_tokens(text_tokens + len(images) + 2 * len(plan), "at least ")
    sizes, held = self._resized_sizes(files, images, img_num)
    stride = self.vit_transform.image_stride
    self.check_sample_tokens(text_tokens + sum(w * h // stride**2 for w, h in sizes)
                             + 2 * len(plan))
    pixels, decoded = [], {}
    target = [(self.vit_transform, img_num)]
    for image in images:
      if image not in decoded:
        data = held.pop(image, None)
        [decoded[image]] = self.load(files.read(image) if data is None else data, target)
      pixels.append(decoded[image])
    return pixels

  def _resized_sizes(self, files: FileStore, images: list, img_num: int
                     ) -> tuple[list[tuple[int, int]], dict[str, bytes]]:
    """Each image's (w, h) after the resize, from its header (no pixel decoded), so the
    sample's size is known before decoding.

    A file named many times is read once. The bytes read are handed back for the
    decode while they total at most `max_image_bytes`; beyond that they are let go
    and read again, so a line of many large files never holds them all.
    """
    sizes, by_path, held, held_bytes = [], {}, {}, 0
    for image in images:
      if image not in by_path:
        data = files.read(image)
        require(isinstance(data, (bytes, bytearray, memoryview)), DropReason.WRONG_TYPE,
                f"image is {type(data).__name__}, not bytes")
        w, h = image_size(bytes(data), max_pixels_decode=self.max_decode_pixels)
        by_path[image] = resize_size(w, h, self.vit_transform, img_num)
        if held_bytes + len(data) <= self.max_image_bytes:
          held[image], held_bytes = data, held_bytes + len(data)
      sizes.append(by_path[image])
    return sizes, held


def video_turn(turn: Any) -> dict:
  """The turn a video's frames go into: upstream replaces `<video>` in the first turn only
  (every occurrence there) and refuses a row whose first turn has none."""
  require(isinstance(turn, dict), DropReason.WRONG_TYPE, "a turn is not an object")
  require(is_text(turn.get("value")), DropReason.BAD_TURN, "a turn's value is not UTF-8 text")
  require("<video>" in turn["value"], DropReason.NO_VIDEO_PLACEHOLDER,
          "a video row's first turn has no <video>")
  return turn


def plan_video_turns(conversations: list, num_frames: int) -> tuple[list[PlanItem], list[str]]:
  """`plan_turns` once every `<video>` of the first turn became `num_frames` `<image>`s.

  Only the first `<video>`'s placeholders can receive frames (the images run out
  there), so each later one becomes a single, ignored `<image>`: the same plan, from a
  string that grows by `num_frames` placeholders, not by that many per `<video>`.
  """
  first = video_turn(conversations[0])
  head, *rest = first["value"].split("<video>")
  if num_frames == 0:  # every `<video>` vanishes; the turn may end up without `<image>`
    value = "".join([head, *rest])
  else:
    value = head + "<image>" * num_frames + "<image>".join(rest)
  return plan_turns([{**first, "value": value}, *conversations[1:]], num_frames)


class _Embedding:
  """A line's files read through `DiskFiles`, each refusal noted under the path the row spells."""

  def __init__(self, data_dir: str, max_video_bytes: int):
    self.disk = DiskFiles(data_dir)
    self.max_video_bytes = max_video_bytes
    self.files: dict[str, bytes] = {}
    self.errors: dict[str, DropReason] = {}

  def locate(self, relative: Any) -> str | None:
    if not is_text(relative) or relative in self.errors:  # not text: dropped as wrong_type
      return None
    try:
      return self.disk.locate(relative)
    except Drop as e:
      self.errors[relative] = e.reason
      return None

  def image(self, relative: Any) -> None:
    path = self.locate(relative)
    if path is not None and relative not in self.files:
      try:
        self.files[relative] = self.disk.read(path)
      except Drop as e:  # absent: `missing_file` when (and only when) the family opens it
        if e.reason != DropReason.MISSING_FILE:
          self.errors[relative] = e.reason  # refused unread (too large, not a regular file)

  def video(self, relative: Any) -> None:
    path = self.locate(relative)
    if path is None:
      return
    if is_folder(path):
      try:
        frames = self.disk.list_frames(path)
      except Drop as e:
        self.errors[relative] = e.reason  # a missing folder, a frame linking out
        return
      for frame in frames:
        name = relative + os.path.basename(frame)
        try:
          self.files[name] = self.disk.read(frame)
        except Drop as e:
          self.errors[name] = e.reason  # still an entry: it counts for the sampling
      return
    try:  # the size is checked before a byte is read, as when the family opens it
      with opened_video(self.disk, path, self.max_video_bytes):
        pass
    except Drop as e:
      if e.reason != DropReason.MISSING_FILE:  # else absent, as on disk
        self.errors[relative] = e.reason
      return
    try:
      self.files[relative] = self.disk.read_video(path, self.max_video_bytes)
    except Drop as e:
      self.errors[relative] = e.reason  # grew past the bound, or vanished, since the check


def embed_files(line: bytes, data_dir: str, *,
                max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES) -> LineWithFiles:
  """The line with the files it references, for the converter: read as the family reads them.

  Through `DiskFiles`, so a converted record drops for the same reason as the
  line read from disk (see `files.EmbeddedFiles`); a video file over `max_video_bytes`
  is recorded as `file_too_large` without being read.
  """
  embedding = _Embedding(data_dir, max_video_bytes)
  try:
    row = parse_row(line)
  except Drop:
    row = {}  # dropped as bad_json when read
  if "image" in row:
    for relative in listed_images(row):
      embedding.image(relative)
  elif "video" in row:
    embedding.video(row["video"])
  return LineWithFiles(line, embedding.files, embedding.errors)


@dataclasses.dataclass(frozen=True)
class VLMOptions(GroupOptions):
  """A VLM group's own key: upstream's `frame_sampler_args`, for its video rows."""

  KEYS = frozenset({"frame_sampler_args"})
  frame_sampler: FrameSamplerArgs = FrameSamplerArgs()

  @classmethod
  def parse(cls, raw: Mapping[str, Any], *, file: str, group: str) -> VLMOptions:
    key = "frame_sampler_args"
    if key not in raw:
      return cls()
    args = raw[key]
    if not isinstance(args, Mapping):
      raise ConfigError("must be a mapping", file=file, group=group, key=key)
    check_keys(args, {"max_num_frames", "min_num_frames", "sample"}, file=file, group=group,
               where=key)
    counts = {k: number(v, int, file=file, group=group, key=f"{key}.{k}")
              for k, v in args.items() if k != "sample"}
    try:
      sample = video.check_sample_mode(args.get("sample", "rand"))
    except ValueError as e:
      raise ConfigError(str(e), file=file, group=group, key=f"{key}.sample") from None
    frames = FrameSamplerArgs(**counts, sample=sample)
    if not 1 <= frames.min_num_frames <= frames.max_num_frames:
      raise ConfigError(f"need 1 <= min_num_frames <= max_num_frames, got {frames.min_num_frames}"
                        f" and {frames.max_num_frames}", file=file, group=group, key=key)
    return cls(frame_sampler=frames)

  def fingerprint(self) -> dict[str, Any]:
    sampler = dataclasses.asdict(self.frame_sampler)
    if sampler["sample"] == "rand":  # `sample` came later: its default hashes as before it
      del sampler["sample"]
    return {"frame_sampler": sampler}


def _transform_args(group: GroupConfig) -> dict[str, Any]:
  return {"frame_sampler": group.options.frame_sampler,
          "data_dirs": tuple(d.data_dir for d in group.datasets)}


FAMILY = Family(
    name="vlm_sft",
    transform=VLMTransform,
    image_roles={"vit": "image_transform"},
    columns=None,  # JSONL lines; their image and video files lie under data_dir
    options=VLMOptions,
    transform_args=_transform_args,
    embed_files=embed_files,
    drop_reasons=RECORD_REASONS | IMAGE_REASONS | FILE_REASONS | VIDEO_REASONS | {
        DropReason.BAD_JSON, DropReason.BLANK_LINE, DropReason.WRONG_TYPE, DropReason.BAD_TURN,
        DropReason.NO_LOSS_ITEM, DropReason.TEXT_TOO_LONG,
        DropReason.OVER_MAX_TOKENS_PER_SAMPLE})
