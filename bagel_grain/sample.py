"""The sample contract: what a family emits and the packer consumes (or a `drops.Dropped`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

ItemType = Literal["text", "vit_image", "vae_image"]


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Ids of the tokens the packer inserts (upstream names in the comments)."""

  bos: int  # bos_token_id = <|im_start|>
  eos: int  # eos_token_id = <|im_end|>
  start_of_image: int  # <|vision_start|>
  end_of_image: int  # <|vision_end|>


@dataclasses.dataclass(frozen=True)
class PlanItem:
  """One entry of a sample's sequence plan, with upstream's field names."""

  type: ItemType
  enable_cfg: int = 0
  loss: int = 0
  special_token_loss: int = 0
  special_token_label: int | None = None
  # Video frames (interleaved data) span one attention split over several items.
  split_start: bool = True
  split_end: bool = True
  frame_delta: int | None = None


@dataclasses.dataclass(frozen=True)
class SampleKey:
  """Where a sample comes from: enough to re-create it and every choice made for it."""

  group: int  # index of the group in the config's group order
  index: int  # position in the group's process-local MapDataset
  epoch: int  # pass over the group's records this element belongs to
  record: str  # readable record id: `file#row` or `file:line`


@dataclasses.dataclass(frozen=True)
class Sample:
  """A sequence plan plus its payloads, in plan order.

  `text_ids` holds one int32 array per text item, `images` one uint8 HWC array per
  image item (already resized for the item's type). Items may share an array
  (an edit chain's loss and clean VAE views of one image are resized once).
  """

  plan: tuple[PlanItem, ...]
  text_ids: tuple[np.ndarray, ...]
  images: tuple[np.ndarray, ...]
  num_tokens: int
  key: SampleKey
  notes: tuple[str, ...] = ()  # `drops.Note` members: kept-but-notable events for stats

  @property
  def packed_size(self) -> int:
    """Upstream's size estimate used for every budget decision."""
    return self.num_tokens + 2 * len(self.plan)
