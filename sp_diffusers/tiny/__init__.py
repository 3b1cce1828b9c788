"""Tiny models from real diffusers classes with small configs, and inputs that fit them.

For the embedded default (demo, trainer), the tests and the benchmarks: no weights are downloaded.
Every model here has a context-parallel plan (diffusers' or sp_diffusers') in every diffusers version that
has its class (LTX-2 and Helios from 0.37, MiniMax-H3 from 0.40: ``families.kinds.kind_available``); default
token counts are multiples of 4 so Ulysses degrees 1, 2 and 4 all divide them (any length works).
"""

from __future__ import annotations

from . import av_models, image_models, video_models, wan_variants  # noqa: F401  (each registers its kinds)
from .pipelines import (
    save_tiny_flux2_klein_pipeline,
    save_tiny_flux_pipeline,
    save_tiny_hunyuanvideo15_pipeline,
    save_tiny_ltx2_pipeline,
    save_tiny_pipeline,
    save_tiny_qwenimage_pipeline,
    save_tiny_sd3_pipeline,
    save_tiny_wan_pipeline,
    save_tiny_zimage_pipeline,
)
from .specs import _KINDS, tiny_inputs, tiny_model, tiny_model_config
from .text_parts import save_tiny_clip
from .vision_parts import save_tiny_dino

TINY_MODELS = tuple(_KINDS)

__all__ = [
    "TINY_MODELS",
    "save_tiny_clip",
    "save_tiny_dino",
    "save_tiny_flux2_klein_pipeline",
    "save_tiny_flux_pipeline",
    "save_tiny_hunyuanvideo15_pipeline",
    "save_tiny_ltx2_pipeline",
    "save_tiny_pipeline",
    "save_tiny_qwenimage_pipeline",
    "save_tiny_sd3_pipeline",
    "save_tiny_wan_pipeline",
    "save_tiny_zimage_pipeline",
    "tiny_inputs",
    "tiny_model",
    "tiny_model_config",
]
