"""Synthetic prepared samples and stage specs for the packer's stage tests (no decoding)."""

from __future__ import annotations

import numpy as np

from bagel_grain.drops import Dropped
from bagel_grain.packing.batch import BatchDataset
from bagel_grain.packing.drop_policy import DropPolicy
from bagel_grain.packing.layout import Geometry, SpecialTokens, layout_sample
from bagel_grain.packing.mix import MixDataset, MixSpec
from bagel_grain.packing.pack import PackDataset, PackSpec
from bagel_grain.packing.prepare import PreparedSample
from bagel_grain.packing.row import Capacities
from bagel_grain.packing.state import StreamIdentity
from bagel_grain.sample import PlanItem, SampleKey

GEOMETRY = Geometry(vit_patch_size=14, vae_downsample=16, max_num_patch_per_side=70,
                    max_latent_size=32, interpolate_pos=False)
SPECIAL = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)
CAPS = Capacities(tokens=1024, vit_patches=1024, vae_tokens=1024, vae_images=8,
                  vae_image_size=32, splits=512)


def make_sample(group, index, text_len, *, vae=False, vit=False, drop_reason=None):
  """A prepared sample of `text_len` text tokens, optionally with a 32x32 VAE / 28x28 ViT image."""
  key = SampleKey(group, index, 0, f"g{group}:{index}")
  if drop_reason:
    return Dropped(drop_reason, key=key)
  plan, texts, images = [PlanItem("text", loss=1)], [np.arange(text_len, dtype=np.int32) + 10], []
  if vit:
    plan.insert(0, PlanItem("vit_image"))
    images.insert(0, np.full((28, 28, 3), 7, np.uint8))
  if vae:
    plan.append(PlanItem("vae_image", loss=1))
    images.append(np.full((32, 32, 3), 9, np.uint8))
  timesteps = (0.5,) if vae else ()
  layout = layout_sample(plan, texts, images, cfg_drops=(), timesteps=timesteps,
                         geometry=GEOMETRY, special=SPECIAL)
  num_tokens = text_len + 4 * vit + 4 * vae
  return PreparedSample(key, num_tokens + 2 * len(plan), layout)


def mixed(groups, *, weights=None, per_sample=1000, caps=CAPS, max_drops=50, window=200,
          max_bad_ratio=0.9, seed=0, fetcher=None):
  """A MixDataset over `groups` (lists of samples), named g0, g1, ..."""
  n = len(groups)
  spec = MixSpec(group_names=tuple(f"g{i}" for i in range(n)),
                 weights=tuple(weights or [1.0] * n),
                 records_per_epoch=tuple(len(g) for g in groups), seed=seed, process_index=0,
                 drops=DropPolicy(max_num_tokens_per_sample=per_sample, capacities=caps,
                                  max_consecutive_drops=max_drops, bad_record_window=window,
                                  max_bad_ratio=max_bad_ratio))
  return MixDataset(groups, spec) if fetcher is None else MixDataset(groups, spec, fetcher)


def packed(groups, *, mandatory=None, expected=900, max_tokens=1024, prefer=400, buffer=4,
           caps=CAPS, **mix_args):
  """A PackDataset over `groups`; `mix_args` go to `mixed`."""
  spec = PackSpec(mandatory=tuple(mandatory or [False] * len(groups)),
                  expected_num_tokens=expected, max_num_tokens=max_tokens,
                  prefer_buffer_before=prefer, max_buffer_size=buffer, capacities=caps)
  return PackDataset(mixed(groups, caps=caps, **mix_args), spec)


def batched(groups, batch_size, **pack_args):
  """A BatchDataset of `batch_size` rows over `groups`; `pack_args` go to `packed`."""
  return BatchDataset(packed(groups, **pack_args), batch_size=batch_size, capacities=CAPS,
                      identity=StreamIdentity({"test": 1}))


def groups_of(sizes):
  """Groups of samples of the given text lengths, some with a VAE or a ViT image."""
  return [[make_sample(g, i, n, vae=i % 2 == 0, vit=i % 3 == 0) for i, n in enumerate(lens)]
          for g, lens in enumerate(sizes)]
