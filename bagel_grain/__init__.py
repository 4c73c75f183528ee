"""bagel_grain: BAGEL's multimodal data pipeline (mix, greedy packing) on Grain, for JAX.

The host side is numpy only; `bagel_grain.jax` holds the device side.
"""

from bagel_grain.config import PipelineConfig, load_config
from bagel_grain.pipeline import build_pipeline, pipeline_stats
from bagel_grain.tokenizer import load_tokenizer

__all__ = ["PipelineConfig", "build_pipeline", "load_config", "load_tokenizer",
           "pipeline_stats"]
