"""Why a record does not become a packed sample: one enum of reasons, one carrier.

A reason's value is the key it is counted under in `pipeline_stats` (and named by
in the README), so the enum is a `StrEnum`: a member equals, hashes and prints
as its value. A new reason is one member here, in the section of the layer that
raises it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from bagel_grain.errors import BagelGrainError

if TYPE_CHECKING:
  from bagel_grain.sample import SampleKey

MAX_DETAIL = 200  # characters of detail kept: enough to find the file, never a whole row


class DropReason(enum.StrEnum):
  """Every reason a record is counted as dropped, grouped by the layer that finds it."""

  # A source could not read the record.
  UNREADABLE_FILE = "unreadable_file"
  CORRUPT_RECORD = "corrupt_record"
  # A family could not parse the record.
  WRONG_TYPE = "wrong_type"
  BAD_JSON = "bad_json"
  # An empty (or whitespace-only) JSONL line. Upstream's reader keeps it as a line (it
  # counts for `num_used_data` and the shuffle) and skips it when it fails to parse; so
  # do we, under its own name. It does not count as bad in the `max_bad_ratio` window.
  BLANK_LINE = "blank_line"
  BAD_TURN = "bad_turn"
  NO_LOSS_ITEM = "no_loss_item"
  BAD_CAPTION = "bad_caption"
  BAD_EDIT_LISTS = "bad_edit_lists"
  TEXT_TOO_LONG = "text_too_long"  # more characters than any sample can hold, never tokenized
  NO_VIDEO_PLACEHOLDER = "no_video_placeholder"  # a `video` row whose first turn lacks `<video>`
  # A file the record references could not be reached.
  MISSING_FILE = "missing_file"
  PATH_OUTSIDE_DATA_DIR = "path_outside_data_dir"
  VIDEO_UNREADABLE = "video_unreadable"
  NOT_A_REGULAR_FILE = "not_a_regular_file"  # a FIFO, device or socket: never opened
  FILE_TOO_LARGE = "file_too_large"  # over `max_image_bytes` / `max_video_bytes`: never read
  # There, but storage refused it for good (access denied, a local I/O error); never a
  # network failure, which is retried (`bagel_grain.storage`).
  FILE_NOT_READABLE = "file_not_readable"
  # A video sample needs more frames sampled or decoded than `max_video_frames`.
  TOO_MANY_VIDEO_FRAMES = "too_many_video_frames"
  # An image could not become pixels.
  BAD_IMAGE = "bad_image"
  TOO_MANY_PIXELS = "too_many_pixels"
  TRUNCATED_IMAGE = "truncated_image"
  TOO_MANY_JPEG_SCANS = "too_many_jpeg_scans"  # a progressive JPEG past images.MAX_JPEG_SCANS
  # The packer: the sample can never fit a row.
  OVER_MAX_TOKENS_PER_SAMPLE = "over_max_tokens_per_sample"
  OVER_ROW_CAPACITY_TOKENS = "over_row_capacity_tokens"
  OVER_ROW_CAPACITY_VIT_PATCHES = "over_row_capacity_vit_patches"
  OVER_ROW_CAPACITY_VAE_TOKENS = "over_row_capacity_vae_tokens"
  OVER_ROW_CAPACITY_VAE_IMAGES = "over_row_capacity_vae_images"
  OVER_ROW_CAPACITY_SPLITS = "over_row_capacity_splits"
  OVER_ROW_CAPACITY_VAE_IMAGE_SIZE = "over_row_capacity_vae_image_size"

  @classmethod
  def over_row_capacity(cls, capacity: str) -> DropReason:
    """The reason for a sample over the row capacity named `capacity` (a `Capacities` field)."""
    return cls(f"over_row_capacity_{capacity}")


class Note(enum.StrEnum):
  """Events of a kept sample worth counting (the sample is packed as upstream packs it)."""

  EMPTY_CAPTION = "empty_caption"  # a T2I row without caption: an unconditional sample
  UNUSED_IMAGES = "unused_images"  # a VLM line listing more images than it places
  # A VLM line with more `<image>` placeholders than images: the extra ones are removed
  # from the text, as upstream removes them.
  UNFILLED_PLACEHOLDERS = "unfilled_placeholders"


RECORD_REASONS = frozenset({DropReason.UNREADABLE_FILE, DropReason.CORRUPT_RECORD})
IMAGE_REASONS = frozenset({DropReason.BAD_IMAGE, DropReason.TOO_MANY_PIXELS,
                           DropReason.TRUNCATED_IMAGE, DropReason.TOO_MANY_JPEG_SCANS})
FILE_REASONS = frozenset({DropReason.MISSING_FILE, DropReason.PATH_OUTSIDE_DATA_DIR,
                          DropReason.VIDEO_UNREADABLE, DropReason.NOT_A_REGULAR_FILE,
                          DropReason.FILE_TOO_LARGE, DropReason.FILE_NOT_READABLE})
VIDEO_REASONS = frozenset({DropReason.NO_VIDEO_PLACEHOLDER, DropReason.TOO_MANY_VIDEO_FRAMES})


@dataclasses.dataclass(frozen=True)
class Dropped:
  """A record that did not become a sample: the reason, a short detail, and its key.

  A source's unreadable record carries one without a key (`Record.error`); the
  family transform places it in the stream with the sample key, and the packer
  counts it under its reason and draws again.
  """

  reason: DropReason
  detail: str = ""
  key: SampleKey | None = None

  def __post_init__(self):
    object.__setattr__(self, "reason", DropReason(self.reason))  # refuses unknown reasons
    if len(self.detail) > MAX_DETAIL:
      object.__setattr__(self, "detail", self.detail[:MAX_DETAIL])

  def at(self, key: SampleKey) -> Dropped:
    """This drop, placed in the stream under `key`."""
    return dataclasses.replace(self, key=key)


class Drop(BagelGrainError):
  """Raised where a record turns out unusable; the family transform emits `dropped`."""

  def __init__(self, reason: DropReason, detail: str = ""):
    super().__init__(reason, detail)
    self.dropped = Dropped(reason, detail)

  @property
  def reason(self) -> DropReason:
    return self.dropped.reason

  def __str__(self) -> str:
    reason, detail = self.dropped.reason, self.dropped.detail
    return f"{reason}: {detail}" if detail else str(reason)


def require(condition: bool, reason: DropReason, detail: str = "") -> None:
  """Raises Drop(reason, detail) unless `condition` holds."""
  if not condition:
    raise Drop(reason, detail)
