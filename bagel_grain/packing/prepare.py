"""Sample -> laid-out sample, with its dropout decisions and timesteps drawn from its key.

Runs element-wise beside the family transform (in worker processes when there are
any), so the main process only concatenates layouts into rows.
"""

from __future__ import annotations

import dataclasses
import functools

import grain
import numpy as np

from bagel_grain.packing.layout import Geometry, SampleLayout, SpecialTokens, draw_sample_choices
from bagel_grain.packing.layout import layout_sample
from bagel_grain.packing.row import Usage
from bagel_grain.drops import Dropped
from bagel_grain.sample import Sample, SampleKey

_CHOICES_STREAM = 0x5A3B1E  # separates these draws from every other use of the seed


@dataclasses.dataclass(frozen=True)
class PreparedSample:
  """What the packer needs of a sample: its budget size, its layout and its key."""

  key: SampleKey
  packed_size: int  # upstream's estimate: num_tokens + 2 * len(plan)
  layout: SampleLayout
  image_tokens: int = 0  # tokens of the distinct resized images: the decode work it cost
  notes: tuple[str, ...] = ()

  @functools.cached_property
  def usage(self) -> Usage:
    """What it occupies in a row: worked out once, for the drop policy and the packer."""
    return Usage.of(self.layout)


def resized_image_tokens(sample: Sample, *, vit_patch_size: int, vae_downsample: int) -> int:
  """Tokens of each distinct resized image: the decode work a sample cost.

  An edit chain's loss and clean VAE views share one array and count once.
  """
  tokens_by_image = {}
  items = (item for item in sample.plan if item.type != "text")
  for item, image in zip(items, sample.images):
    stride = vit_patch_size if item.type == "vit_image" else vae_downsample
    tokens_by_image[id(image)] = image.shape[0] * image.shape[1] // stride**2
  return sum(tokens_by_image.values())


def sample_rng(seed: int, key: SampleKey, shard: int = 0) -> np.random.Generator:
  """The per-sample generator for packing-time choices, keyed by (seed, shard, sample key).

  Shard 0 (and every shard of the default one-shard-per-process layout) keeps the
  key without a shard, the key of the stream before logical shards.
  """
  shard_key = [shard] if shard else []
  return np.random.default_rng([seed, _CHOICES_STREAM, key.group, key.index, *shard_key])


@dataclasses.dataclass(frozen=True)
class PrepareSample(grain.transforms.Map):
  seed: int
  geometry: Geometry
  special: SpecialTokens
  text_cond_dropout_prob: float
  vit_cond_dropout_prob: float
  vae_cond_dropout_prob: float
  shard: int = 0  # folded into the sample's RNG key (see `sample_rng`)

  def map(self, element: Sample | Dropped) -> PreparedSample | Dropped:
    if isinstance(element, Dropped):
      return element
    drops, timesteps = draw_sample_choices(
        element.plan, sample_rng(self.seed, element.key, self.shard),
        text_p=self.text_cond_dropout_prob, vit_p=self.vit_cond_dropout_prob,
        vae_p=self.vae_cond_dropout_prob)
    layout = layout_sample(element.plan, element.text_ids, element.images, cfg_drops=drops,
                           timesteps=timesteps, geometry=self.geometry, special=self.special)
    image_tokens = resized_image_tokens(element, vit_patch_size=self.geometry.vit_patch_size,
                                        vae_downsample=self.geometry.vae_downsample)
    return PreparedSample(element.key, element.packed_size, layout, image_tokens, element.notes)
