"""The device side of bagel_grain: global sharded batches, on-device preparation,
attention masks and Orbax checkpoints of the iterator. Importing it imports JAX.
"""

from bagel_grain.jax.attention import (
    KeyIntervals, block_summary, dense_mask, key_intervals, mask_block, splash_mask,
    token_split_modes)
from bagel_grain.jax.checkpoint import checkpoint_manager, restore, save
from bagel_grain.jax.global_batch import (
    DeviceBatch, DevicePrefetchIterator, batch_partition_spec, device_iterator,
    field_shardings, make_global_batch)
from bagel_grain.jax.prepare import (
    assemble_sequence, gather_tokens, gather_vae_latents, normalize_pixels,
    normalize_vae_images, normalize_vit_patches, prepare_pixels, scatter_tokens,
    vae_latent_grid_index)

__all__ = [
    "DeviceBatch", "DevicePrefetchIterator", "KeyIntervals", "assemble_sequence",
    "batch_partition_spec", "block_summary", "checkpoint_manager", "dense_mask",
    "device_iterator", "field_shardings", "gather_tokens", "gather_vae_latents",
    "key_intervals", "make_global_batch", "mask_block", "normalize_pixels",
    "normalize_vae_images", "normalize_vit_patches", "prepare_pixels", "restore", "save",
    "scatter_tokens", "splash_mask", "token_split_modes", "vae_latent_grid_index",
]
