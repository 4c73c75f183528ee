"""bagel_grain: BAGEL's multimodal data pipeline (mix, greedy packing) on Grain, for JAX.

The host side is numpy only; `bagel_grain.jax` holds the device side. The names below
load on first use, so a command that needs none of them (`bagel-grain ledger`) starts
without importing Grain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bagel_grain.lazy_names import lazy_getattr

if TYPE_CHECKING:
  from bagel_grain.config import PipelineConfig, load_config
  from bagel_grain.packed_row import PackedBatch, PackedRow, SplitMode, TokenType
  from bagel_grain.packing.bagel_dict import to_bagel_dict
  from bagel_grain.pipeline import build_pipeline, pipeline_stats
  from bagel_grain.tokenizer import load_tokenizer

_HOMES = {
    "PipelineConfig": "bagel_grain.config", "load_config": "bagel_grain.config",
    "PackedBatch": "bagel_grain.packed_row", "PackedRow": "bagel_grain.packed_row",
    "SplitMode": "bagel_grain.packed_row", "TokenType": "bagel_grain.packed_row",
    "to_bagel_dict": "bagel_grain.packing.bagel_dict",
    "build_pipeline": "bagel_grain.pipeline", "pipeline_stats": "bagel_grain.pipeline",
    "load_tokenizer": "bagel_grain.tokenizer",
}
__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES, globals())


def __dir__() -> list[str]:
  return sorted({*globals(), *_HOMES})
