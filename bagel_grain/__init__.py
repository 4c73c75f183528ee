"""bagel_grain: BAGEL's multimodal data pipeline (mix, greedy packing) on Grain, for JAX.

The host side is numpy only; `bagel_grain.jax` holds the device side.
"""

from bagel_grain.config import PipelineConfig, load_config
from bagel_grain.packed_row import PackedBatch, PackedRow, SplitMode, TokenType
from bagel_grain.packing.bagel_dict import to_bagel_dict
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from bagel_grain.tokenizer import load_tokenizer

__all__ = ["PackedBatch", "PackedRow", "PipelineConfig", "SplitMode", "TokenType",
           "build_pipeline", "load_config", "load_tokenizer", "pipeline_stats",
           "to_bagel_dict"]
