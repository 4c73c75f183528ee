"""2-D position ids of image patches, extrapolated or interpolated (docs/design.md, section 3)."""

from __future__ import annotations

import functools
import math

import numpy as np


_TORCH_F32_LANES = 8  # Vectorized<float>::size() of torch's AVX2 CPU kernels.


def _torch_arange_f32(start: float, end: float, step: float) -> np.ndarray:
  """Bit-exact values of torch.arange(start, end, step) in float32 on CPU.

  Torch computes in double, but its SIMD path fills each 8-lane vector as
  `float32(base) + j * step` with `base = start + step * idx` rounded to float32
  first; elements past the last full pair of vectors come from the scalar path,
  `float32(start + step * i)`. A plain float64 arange cast to float32 differs at
  some bucket boundaries (e.g. n = 25, 49, 50, 55, 77 with M = 70).
  """
  n = max(0, math.ceil((end - start) / step))
  i = np.arange(n, dtype=np.int64)
  lanes = _TORCH_F32_LANES
  base_idx = (i // lanes) * lanes
  base = (start + step * base_idx).astype(np.float32).astype(np.float64)
  vec = (base + (i - base_idx) * step).astype(np.float32)
  scalar = (start + step * i).astype(np.float32)
  return np.where(i < n - n % (2 * lanes), vec, scalar)


@functools.lru_cache(maxsize=1024)
def _axis_buckets(n: int, max_per_side: int) -> np.ndarray:
  """Upstream's `bucketize(arange(0, 1 - 1e-6, 1/n), arange(1/M, 1, 1/M), right=True)`."""
  coords = _torch_arange_f32(0.0, 1.0 - 1e-6, 1.0 / n)
  bounds = _torch_arange_f32(1.0 / max_per_side, 1.0, 1.0 / max_per_side)
  out = np.searchsorted(bounds, coords, side="right").astype(np.int32)
  out.setflags(write=False)
  return out


@functools.lru_cache(maxsize=1024)
def _grid_ids(rows: int, cols: int, max_per_side: int, interpolate: bool) -> np.ndarray:
  """Cached flattened ids for one grid; read-only since callers share it."""
  if interpolate:
    r, c = _axis_buckets(rows, max_per_side), _axis_buckets(cols, max_per_side)
  else:
    r, c = np.arange(rows, dtype=np.int32), np.arange(cols, dtype=np.int32)
  out = (r[:, None] * max_per_side + c[None, :]).astype(np.int32).reshape(-1)
  out.setflags(write=False)
  return out


def flattened_position_ids(img_h: int, img_w: int, patch_size: int, max_num_patches_per_side: int,
                           *, interpolate: bool) -> np.ndarray:
  """Row-major position id of every patch of an img_h x img_w image (int32, read-only).

  Extrapolate: `row * M + col`. Interpolate: each axis's patch index bucketed into
  M buckets, then `bucket_h * M + bucket_w`.
  """
  return _grid_ids(img_h // patch_size, img_w // patch_size, max_num_patches_per_side, bool(interpolate))
