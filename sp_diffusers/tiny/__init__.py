"""Tiny models from real diffusers classes with small configs, and inputs that fit them.

For the embedded default (demo, trainer), the tests and the benchmarks: no weights are downloaded.
Every model here has a context-parallel plan in every supported diffusers version; default token counts are
multiples of 4 so Ulysses degrees 1, 2 and 4 all divide them.

    _registry.py       tiny_model / tiny_model_config / tiny_inputs over the registered kinds
    image_models.py    Qwen-Image, Flux, SD3
    video_models.py    Wan, HunyuanVideo, CogVideoX
    pipelines.py       whole pipelines written with save_pretrained (SD3, Wan), the tiny UMT5 text encoder
"""

from __future__ import annotations

from . import image_models, video_models  # noqa: F401  (each registers its kinds)
from ._registry import _KINDS, tiny_inputs, tiny_model, tiny_model_config
from .pipelines import save_tiny_sd3_pipeline, save_tiny_wan_pipeline

TINY_MODELS = tuple(_KINDS)

__all__ = [
    "TINY_MODELS",
    "save_tiny_sd3_pipeline",
    "save_tiny_wan_pipeline",
    "tiny_inputs",
    "tiny_model",
    "tiny_model_config",
]
