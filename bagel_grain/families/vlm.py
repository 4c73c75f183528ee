"""VLM SFT rows (JSONL + image files, video frames) -> interleaved ViT images and text turns."""

from __future__ import annotations

import io
import json
import os

import numpy as np

from bagel_grain import fs
from bagel_grain.config import FrameSamplerArgs
from bagel_grain.families import video
from bagel_grain.drops import Drop, DropReason, require
from bagel_grain.families.base import FamilyTransform, is_text
from bagel_grain.images import ImageTransform, resize_image
from bagel_grain.sample import PlanItem, Sample
from bagel_grain.sources.framing import LineWithFiles
from bagel_grain.sources.records import Record

IMAGE = PlanItem("vit_image", enable_cfg=0, loss=0)
PROMPT = PlanItem("text", enable_cfg=0, loss=0)
ANSWER = PlanItem("text", enable_cfg=0, loss=1)


def _check_relative(relative: str) -> None:
  """Drop unless `relative` is a non-empty relative path string."""
  require(is_text(relative) and relative != "", DropReason.WRONG_TYPE,
          "path is not UTF-8 text")
  require(not os.path.isabs(relative) and not fs.is_uri(relative) and "\x00" not in relative,
          DropReason.PATH_OUTSIDE_DATA_DIR, relative)


def inside(data_dir: str, relative: str) -> str:
  """The path of `relative` under `data_dir`; Drop when it would leave the directory."""
  _check_relative(relative)
  path = fs.join(data_dir, relative)
  if fs.is_uri(data_dir):
    normalised = os.path.normpath(relative)
    require(normalised != ".." and not normalised.startswith("../"),
            DropReason.PATH_OUTSIDE_DATA_DIR, relative)
    return path
  root = os.path.realpath(data_dir)
  real = os.path.realpath(path)  # follows symlinks: a link out of data_dir is refused too
  require(real == root or real.startswith(root + os.sep), DropReason.PATH_OUTSIDE_DATA_DIR,
          relative)
  return real + (os.sep if relative.endswith("/") else "")


def embedded(files: LineWithFiles, relative: str) -> str:
  """`relative` as a key of a converted record's files, with the verdict `inside` gave.

  The converter ran `inside` on the disk and recorded each refusal in `file_errors`;
  embedded bytes are never looked up on disk, so nothing here can leave `data_dir`.
  """
  _check_relative(relative)
  if relative in files.file_errors:
    raise Drop(files.file_errors[relative], relative)
  return relative


def plan_turns(conversations, num_images: int) -> tuple[list[PlanItem], list[str]]:
  """Plan items and texts of the turns; an image item per `<image>` while images remain."""
  require(isinstance(conversations, list), DropReason.WRONG_TYPE, "conversations is not a list")
  plan, texts, images_left = [], [], num_images
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
        if i < len(pieces) - 1 and images_left > 0:  # extra placeholders are ignored
          plan.append(IMAGE)
          images_left -= 1
    elif role == "gpt":
      plan.append(ANSWER)
      texts.append(value)
  return plan, texts


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

  def _read(self, path: str, files: LineWithFiles | None) -> bytes:
    if files is not None:  # a converted record: its files travel with it
      if path not in files.files:
        raise Drop(files.file_errors.get(path, DropReason.MISSING_FILE), path)
      return files.files[path]
    try:
      return fs.read_bytes(path)
    except OSError as e:
      raise Drop(DropReason.MISSING_FILE, str(e)) from None

  def _video_frames(self, path: str, rng: np.random.Generator,
                    files: LineWithFiles | None) -> list:
    args = self.frame_sampler
    if path.endswith(os.sep) or path.endswith("/"):
      frames = (video.frame_folder(path) if files is None else
                video.embedded_frames([*files.files, *files.file_errors], path))
      indices = video.sample_frame_indices(len(frames), args.min_num_frames,
                                           args.max_num_frames, rng)
      return [frames[i] for i in indices]
    if not (fs.exists(path) if files is None else path in files.files):
      raise Drop(DropReason.MISSING_FILE, path)
    opened = (lambda: path) if files is None else (lambda: io.BytesIO(files.files[path]))
    indices = video.sample_frame_indices(video.count_video_frames(opened()), args.min_num_frames,
                                         args.max_num_frames, rng)
    return video.read_video_frames(opened(), indices)

  def parse(self, record: Record, rng: np.random.Generator) -> Sample:
    line, files = record.fields, None
    if isinstance(line, LineWithFiles):
      line, files = line.line, line
    try:
      row = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
      raise Drop(DropReason.BAD_JSON, str(e)) from None
    require(isinstance(row, dict), DropReason.BAD_JSON, "line is not a JSON object")
    data_dir = self.data_dirs[record.dataset]
    locate = (lambda p: inside(data_dir, p)) if files is None else (lambda p: embedded(files, p))
    conversations = row.get("conversations")
    require(isinstance(conversations, list), DropReason.WRONG_TYPE,
            "conversations missing or not a list")
    images: list = []  # paths, or PIL images for frames of a video file
    if "image" in row:
      listed = row["image"] if isinstance(row["image"], list) else [row["image"]]
      images = [locate(p) for p in listed]
    elif "video" in row:
      images = self._video_frames(locate(row["video"]), rng, files)
      placeholder = "<image>" * len(images)
      conversations = [
          {**t, "value": t["value"].replace("<video>", placeholder)}
          if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str)
          else t for t in conversations]
    plan, texts = plan_turns(conversations, len(images))
    require(any(item.loss for item in plan), DropReason.NO_LOSS_ITEM)
    used = sum(item.type == "vit_image" for item in plan)
    notes = ("unused_images",) if used < len(images) else ()
    pixels = []
    target = [(self.vit_transform, len(images))]
    for image in images[:used]:
      if isinstance(image, str):
        pixels.extend(self.load(self._read(image, files), target))
      else:  # a frame decoded from a video file
        pixels.append(resize_image(image, self.vit_transform, len(images)))
    text_ids = tuple(self.tokenizer.encode_batch(texts))
    num_tokens = sum(len(t) for t in text_ids) + sum(
        self.image_tokens(p, self.vit_transform.image_stride) for p in pixels)
    return Sample(tuple(plan), text_ids, tuple(pixels), num_tokens, self.key(record), notes)
