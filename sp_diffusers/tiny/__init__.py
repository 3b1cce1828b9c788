"""Tiny models from real diffusers classes with small configs, and inputs that fit them.

For the embedded default (demo, trainer), the tests and the benchmarks: no weights are downloaded.
Every model here has a context-parallel plan (diffusers' or sp_diffusers') in every diffusers version that
has its class (LTX-2 and Helios from 0.37, MiniMax-H3 from 0.40: ``model_kinds.kind_available``); default
token counts are multiples of 4 so Ulysses degrees 1, 2 and 4 all divide them (any length works).

    _registry.py       tiny_model / tiny_model_config / tiny_inputs over the registered kinds
    image_models.py    Qwen-Image, Flux, Flux.2, SD3, Z-Image
    video_models.py    Wan, HunyuanVideo, HunyuanVideo-1.5, CogVideoX
    wan_variants.py    ChronoEdit, Wan-VACE, Helios
    av_models.py       LTX-Video, LTX-2 (audio + video), MiniMax-H3
    pipelines.py       whole pipelines written with save_pretrained (Qwen-Image, Flux, SD3, Wan 2.1 / 2.2)
    text_parts.py      their tiny text encoders, tokenizers and VAEs; a tiny CLIP folder (the CLIP reward)
"""

from __future__ import annotations

from . import av_models, image_models, video_models, wan_variants  # noqa: F401  (each registers its kinds)
from ._registry import _KINDS, tiny_inputs, tiny_model, tiny_model_config
from .pipelines import (
    save_tiny_flux_pipeline,
    save_tiny_pipeline,
    save_tiny_qwenimage_pipeline,
    save_tiny_sd3_pipeline,
    save_tiny_wan_pipeline,
)
from .text_parts import save_tiny_clip

TINY_MODELS = tuple(_KINDS)

__all__ = [
    "TINY_MODELS",
    "save_tiny_clip",
    "save_tiny_flux_pipeline",
    "save_tiny_pipeline",
    "save_tiny_qwenimage_pipeline",
    "save_tiny_sd3_pipeline",
    "save_tiny_wan_pipeline",
    "tiny_inputs",
    "tiny_model",
    "tiny_model_config",
]
