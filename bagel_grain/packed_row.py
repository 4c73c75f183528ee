"""The packed row, written once: its fields, their codes and pixel values (numpy only).

`PackedRow` is the one field table: each key is annotated with a `Field` (dtype,
shape in capacity symbols, fill of an empty slot, meaning). `ROW_SPEC`, the empty
row (`packing.row.empty_row`), the row builder and docs/packed_row.md are made from
it, and the device side (`bagel_grain.jax`) reads the codes from here.

Shape symbols: L tokens, K splits, V ViT patch slots, P = 3 * vit_patch_size**2
bytes per patch, T VAE latent-token slots, I VAE image slots of S x S pixels. A
batch adds a leading B.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Annotated, TypedDict

import numpy as np


class TokenType(enum.IntEnum):
  """What sits at a row position (`token_type`)."""

  PAD = 0
  TEXT = 1  # text, and the start and end marker around every image
  VIT = 2  # a ViT patch
  VAE = 3  # a VAE latent token


class SplitMode(enum.IntEnum):
  """How the tokens of an attention split see each other (`split_modes`).

  A query sees the earlier keys of its sample; inside a full or noise split it
  also sees the later keys of its split; nobody outside a noise split sees into it.
  """

  CAUSAL = 0
  FULL = 1
  NOISE = 2


MODE_NAMES = tuple(mode.name.lower() for mode in SplitMode)  # upstream's names, by code

# What each uint8 pixel value becomes for the model: (x/255 - 0.5)/0.5 in float32,
# the operations torchvision performs. A table, so host and device agree to the bit
# (XLA's division is not correctly rounded on every backend; a lookup is exact).
PIXEL_VALUES = ((np.arange(256, dtype=np.float32) / np.float32(255) - np.float32(0.5))
                / np.float32(0.5))
PIXEL_VALUES.setflags(write=False)


@dataclasses.dataclass(frozen=True)
class Field:
  """One field of a packed row.

  `shape` names capacity symbols ("V P": a V x P array; "": a scalar); `fill` is
  the value of an empty slot, a number or "L" (the row length, as a sentinel
  position that scatters nowhere).
  """

  dtype: str
  shape: str
  fill: int | str
  meaning: str
  name: str = ""

  @property
  def symbols(self) -> tuple[str, ...]:
    return tuple(self.shape.split())

  def shape_for(self, dims: dict[str, int]) -> tuple[int, ...]:
    """The array shape, given a number for each symbol."""
    return tuple(dims[s] if s in dims else int(s) for s in self.symbols)

  def fill_for(self, dims: dict[str, int]) -> int:
    return dims[self.fill] if isinstance(self.fill, str) else self.fill


class PackedRow(TypedDict):
  """One packed sequence as static-shape arrays (numpy on the host, jax on the device)."""

  text_ids: Annotated[np.ndarray, Field(
      "int32", "L", 0, "token id at text positions and at image markers; 0 elsewhere")]
  token_type: Annotated[np.ndarray, Field(
      "int8", "L", 0, "a `TokenType`: 0 padding, 1 text or marker, 2 ViT patch, 3 VAE latent")]
  position_ids: Annotated[np.ndarray, Field(
      "int32", "L", 0, "RoPE position, from 0 in each sample; an image's tokens share one")]
  segment_ids: Annotated[np.ndarray, Field(
      "int32", "L", 0, "sample number in the row, from 1; 0 on padding")]
  split_ids: Annotated[np.ndarray, Field(
      "int32", "L", 0, "attention split number in the row, from 1; 0 on padding")]
  split_lens: Annotated[np.ndarray, Field(
      "int32", "K", 0, "tokens of each split, in row order")]
  split_modes: Annotated[np.ndarray, Field(
      "int8", "K", 0, "a `SplitMode` per split: 0 causal, 1 full, 2 noise")]
  label_ids: Annotated[np.ndarray, Field(
      "int32", "L", 0, "next-token label where `ce_weights` > 0")]
  ce_weights: Annotated[np.ndarray, Field(
      "float32", "L", 0, "cross-entropy weight; 0 where no text loss is taken")]
  timesteps: Annotated[np.ndarray, Field(
      "float32", "L", 0, "at VAE latents: the image's flow-matching timestep (logit), "
      "-inf for a clean conditioning image")]
  mse_mask: Annotated[np.ndarray, Field(
      "bool", "L", 0, "latents that are noised and take the flow-matching loss")]
  vit_patches: Annotated[np.ndarray, Field(
      "uint8", "V P", 0, "raw pixels of each ViT patch, laid out (row, column, channel)")]
  vit_position_ids: Annotated[np.ndarray, Field(
      "int32", "V", 0, "2-D position id of each patch on the ViT position grid")]
  vit_token_index: Annotated[np.ndarray, Field(
      "int32", "V", "L", "row position of each patch; L marks an empty slot")]
  vit_image_ids: Annotated[np.ndarray, Field(
      "int32", "V", 0, "ViT image number in the row, from 1; 0 marks an empty slot")]
  vae_images: Annotated[np.ndarray, Field(
      "uint8", "I S S 3", 0, "VAE input images, top-left in their slots, zero around")]
  vae_image_hw: Annotated[np.ndarray, Field(
      "int32", "I 2", 0, "real height and width of each VAE image; 0 for an empty slot")]
  vae_latent_position_ids: Annotated[np.ndarray, Field(
      "int32", "T", 0, "2-D position id of each latent token on the latent grid")]
  vae_token_index: Annotated[np.ndarray, Field(
      "int32", "T", "L", "row position of each latent token; L marks an empty slot")]
  num_tokens: Annotated[np.ndarray, Field("int32", "", 0, "positions holding a token")]
  num_vit_tokens: Annotated[np.ndarray, Field("int32", "", 0, "ViT patch slots used")]
  num_vae_tokens: Annotated[np.ndarray, Field("int32", "", 0, "VAE latent slots used")]
  num_samples: Annotated[np.ndarray, Field("int32", "", 0, "samples in the row")]


class PackedBatch(PackedRow):
  """B packed rows: every field gains a leading B; `sample_keys` stays on the host.

  `sample_keys[b]` lists row b's samples as (group name, index, epoch, record id),
  for audits and debugging; a finite stream's last batch pads with empty rows.
  """

  sample_keys: list[tuple[tuple[str, int, int, str], ...]]


def _row_spec() -> dict[str, Field]:
  hints = typing.get_type_hints(PackedRow, include_extras=True)
  return {name: dataclasses.replace(hint.__metadata__[0], name=name)
          for name, hint in hints.items()}


ROW_SPEC: dict[str, Field] = _row_spec()  # name -> Field, in row order
ROW_FIELDS: tuple[str, ...] = tuple(ROW_SPEC)


def fields_markdown() -> str:
  """The field table of docs/packed_row.md."""
  lines = ["| field | dtype | shape | empty slot | meaning |", "|---|---|---|---|---|"]
  for f in ROW_SPEC.values():
    shape = f"[{', '.join(f.symbols)}]" if f.symbols else "scalar"
    lines.append(f"| `{f.name}` | {f.dtype} | {shape} | {f.fill} | {f.meaning} |")
  return "\n".join(lines) + "\n"
