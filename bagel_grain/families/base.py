"""What every family transform shares: record -> Sample, or a Dropped marker with a reason."""

from __future__ import annotations

import abc
from typing import Any, Sequence

import grain
import numpy as np

from bagel_grain.drops import Drop, Dropped, DropReason, require
from bagel_grain.families.video import DEFAULT_MAX_VIDEO_BYTES, DEFAULT_MAX_VIDEO_FRAMES
from bagel_grain.images import DEFAULT_MAX_IMAGE_BYTES, ImageTransform, decode_resized
from bagel_grain.sample import Sample, SampleKey
from bagel_grain.sources.records import Record


def is_text(value: Any) -> bool:
  """A str that UTF-8 can hold: JSON's `\\ud800` escapes decode to lone surrogates,
  which the tokenizer and the filesystem layer refuse with a TypeError or
  UnicodeEncodeError instead of a drop."""
  if not isinstance(value, str):
    return False
  try:
    value.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


class FamilyTransform(grain.transforms.RandomMap, abc.ABC):
  """A Grain RandomMap from `Record` to `Sample | Dropped`.

  Every random choice is drawn from the generator Grain hands us, which it seeds
  from (seed, element index): the sample key alone re-creates the sample.
  """

  def __init__(self, *, group: int, tokenizer, max_decode_pixels: int,
               max_text_chars: int | None = None, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
               max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
               max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES, jpeg_draft: bool = False,
               max_sample_tokens: int | None = None):
    self.group = group
    self.tokenizer = tokenizer
    self.max_decode_pixels = max_decode_pixels
    self.max_text_chars = max_text_chars
    self.max_sample_tokens = max_sample_tokens  # `max_num_tokens_per_sample`; None: unchecked
    self.max_image_bytes = max_image_bytes
    self.max_video_bytes = max_video_bytes  # for families with video: a larger file is not opened
    self.max_video_frames = max_video_frames  # frames sampled or decoded for one video sample
    self.jpeg_draft = jpeg_draft

  @abc.abstractmethod
  def parse(self, record: Record, rng: np.random.Generator) -> Sample:
    """Builds the sample or raises Drop."""

  def key(self, record: Record) -> SampleKey:
    return SampleKey(self.group, record.index, record.epoch, record.record_id)

  read_ahead = None  # set by the pipeline: where `files_ahead`'s files are read ahead into

  def files_ahead(self, record: Record) -> list[str]:  # pylint: disable=unused-argument
    """The files `parse` will read for `record` (read ahead, see `sources.readahead`)."""
    return []

  def random_map(self, record: Record, rng: np.random.Generator) -> Sample | Dropped:
    if record.error is not None:
      return record.error.at(self.key(record))
    try:
      return self.parse(record, rng)
    except Drop as e:  # an ImageError too
      return e.dropped.at(self.key(record))

  def load(self, data: Any, targets: Sequence[tuple[ImageTransform, int]]) -> list[np.ndarray]:
    """Encoded image bytes, decoded once and resized to each (transform, img_num)."""
    require(isinstance(data, (bytes, bytearray, memoryview)), DropReason.WRONG_TYPE,
            f"image is {type(data).__name__}, not bytes")
    require(len(data) <= self.max_image_bytes, DropReason.FILE_TOO_LARGE,  # a converted record's
            f"an image of {len(data)} bytes > max_image_bytes {self.max_image_bytes}")
    return decode_resized(bytes(data), targets, max_pixels_decode=self.max_decode_pixels,
                          jpeg_draft=self.jpeg_draft)

  @staticmethod
  def image_tokens(pixels: np.ndarray, stride: int) -> int:
    """Upstream's token estimate for a resized image."""
    return pixels.shape[0] * pixels.shape[1] // stride**2

  def check_text_length(self, texts: Sequence[str]) -> None:
    """Drop (text_too_long) texts that cannot fit a sample, before any tokenizing.

    A token covers at most `tokenizer.longest_token_chars` characters, so more than
    `max_text_chars` (that times `max_num_tokens_per_sample`) are more tokens than a
    sample may hold: such a record is dropped at once instead of tokenizing megabytes.
    """
    chars = sum(len(t) for t in texts)
    require(self.max_text_chars is None or chars <= self.max_text_chars,
            DropReason.TEXT_TOO_LONG,
            f"{chars} characters of text; at most {self.max_text_chars} can fit a sample")

  def check_sample_tokens(self, packed_size: int, what: str = "") -> None:
    """Drop (over_max_tokens_per_sample) a sample whose packed size (`Sample.packed_size`,
    or a lower bound of it) is over `max_sample_tokens`: the packer would drop it anyway,
    so it is dropped before its images are decoded."""
    require(self.max_sample_tokens is None or packed_size <= self.max_sample_tokens,
            DropReason.OVER_MAX_TOKENS_PER_SAMPLE,
            f"{what}{packed_size} tokens > max_num_tokens_per_sample {self.max_sample_tokens}")

  def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text (int32), after `check_text_length`."""
    self.check_text_length(texts)
    return self.tokenizer.encode_batch(texts)

  def encode(self, text: str) -> np.ndarray:
    return self.tokenize([text])[0]
