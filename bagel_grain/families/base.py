"""What every family transform shares: record -> Sample, or a Dropped marker with a reason."""

from __future__ import annotations

import abc
from typing import Any

import grain
import numpy as np

from bagel_grain.images import ImageError, ImageTransform, decode_image, resize_image
from bagel_grain.sample import Dropped, Sample, SampleKey
from bagel_grain.sources.records import Record


class Drop(Exception):
  """Raised inside a parser: the record becomes a Dropped marker with this reason."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(reason, detail)
    self.reason, self.detail = reason, detail


def require(condition: bool, reason: str, detail: str = "") -> None:
  if not condition:
    raise Drop(reason, detail)


class FamilyTransform(grain.transforms.RandomMap, abc.ABC):
  """A Grain RandomMap from `Record` to `Sample | Dropped`.

  Every random choice is drawn from the generator Grain hands us, which it seeds
  from (seed, element index): the sample key alone re-creates the sample.
  """

  def __init__(self, *, group: int, tokenizer, max_decode_pixels: int):
    self.group = group
    self.tokenizer = tokenizer
    self.max_decode_pixels = max_decode_pixels

  @abc.abstractmethod
  def parse(self, record: Record, rng: np.random.Generator) -> Sample:
    """Builds the sample or raises Drop."""

  def key(self, record: Record) -> SampleKey:
    return SampleKey(self.group, record.index, record.epoch, record.record_id)

  def random_map(self, record: Record, rng: np.random.Generator) -> Sample | Dropped:
    if record.error is not None:
      reason, _, detail = record.error.partition(":")
      return Dropped(reason, self.key(record), detail)
    try:
      return self.parse(record, rng)
    except Drop as e:
      return Dropped(e.reason, self.key(record), e.detail)
    except ImageError as e:
      return Dropped(e.reason, self.key(record), str(e)[:200])

  def decode(self, data: Any):
    require(isinstance(data, (bytes, bytearray, memoryview)), "wrong_type",
            f"image is {type(data).__name__}, not bytes")
    return decode_image(bytes(data), max_pixels_decode=self.max_decode_pixels)

  @staticmethod
  def resize(image, transform: ImageTransform, img_num: int = 1) -> np.ndarray:
    return resize_image(image, transform, img_num)

  @staticmethod
  def image_tokens(pixels: np.ndarray, stride: int) -> int:
    """Upstream's token estimate for a resized image."""
    return pixels.shape[0] * pixels.shape[1] // stride**2

  def encode(self, text: str) -> np.ndarray:
    return self.tokenizer.encode(text)
