"""The image-conditioned built-ins of the planner, as facts (``models.py`` builds their ``ModelSpec``s).

Sources (the ``transformer/config.json`` of each repository, as diffusers' ``scripts/convert_wan_to_diffusers.py``
writes the Wan ones; the edit models reuse their text-to-image transformer unchanged):
- ``qwen-image-edit``: Qwen/Qwen-Image-Edit: Qwen-Image's transformer config (60 layers, 24 x 128 heads, in 64);
  the condition image's packed tokens join the sequence (the pipeline resizes it to ~1 MP: at a ~1 MP output as many
  condition tokens as output tokens).
- ``qwen-image-edit-2509``, ``qwen-image-edit-2511``: Qwen/Qwen-Image-Edit-2509 and -2511 (``QwenImageEditPlusPipeline``):
  the same transformer config, 2511's with ``zero_cond_t`` (the condition tokens modulated at timestep 0); 1 to 3
  condition images a row, each image's tokens joining the sequence (counted at the output's size, 3 by default).
- ``flux.1-kontext-dev``: black-forest-labs/FLUX.1-Kontext-dev: FLUX.1-dev's transformer config (guidance-distilled);
  the condition tokens join the sequence as for Qwen-Image-Edit.
- ``wan2.1-i2v-14b-720p``: Wan-AI/Wan2.1-I2V-14B-720P-Diffusers: Wan2.1-14B with ``in_channels`` 36 (16 noisy + 4
  mask + 16 first-frame latents), ``image_dim`` 1280 and ``added_kv_proj_dim`` 5120 (CLIP ViT-H: 257 image tokens
  before the 512 text rows).
- ``wan2.2-i2v-a14b``: Wan-AI/Wan2.2-I2V-A14B-Diffusers: two Wan2.1-14B-shaped experts with ``in_channels`` 36 and no
  image encoder (``boundary_ratio`` 0.9).
- ``wan2.2-ti2v-5b``: Wan-AI/Wan2.2-TI2V-5B-Diffusers: 30 layers, 24 x 128 heads, ffn 14336, ``in/out_channels``
  48; its VAE (``AutoencoderKLWan`` of Wan2.2) compresses 16x in space and 4x in time; the first latent frame is the
  image's and every token has its own timestep.
"""

from __future__ import annotations

from typing import Any

from .released_configs import FLUX_DEV, QWEN_IMAGE, WAN_14B

__all__ = ["CONDITION_IMAGES", "COND_SPECS"]

# name -> (kind, family name in models.FAMILIES, config, condition, experts, source, default (h, w, frames))
COND_SPECS: dict[str, tuple[str, str, dict[str, Any], str, int, str, tuple[int, int, int]]] = {
    "qwen-image-edit": (
        "qwenimage",
        "qwenimage",
        QWEN_IMAGE,
        "edit",
        1,
        "Qwen/Qwen-Image-Edit",
        (1024, 1024, 1),
    ),
    "qwen-image-edit-2509": (
        "qwenimage",
        "qwenimage",
        QWEN_IMAGE,
        "edit",
        1,
        "Qwen/Qwen-Image-Edit-2509",
        (1024, 1024, 1),
    ),
    "qwen-image-edit-2511": (
        "qwenimage",
        "qwenimage",
        {**QWEN_IMAGE, "zero_cond_t": True},
        "edit",
        1,
        "Qwen/Qwen-Image-Edit-2511",
        (1024, 1024, 1),
    ),
    "flux.1-kontext-dev": (
        "flux",
        "flux",
        FLUX_DEV,
        "edit",
        1,
        "black-forest-labs/FLUX.1-Kontext-dev",
        (1024, 1024, 1),
    ),
    "wan2.1-i2v-14b-720p": (
        "wan",
        "wan",
        {**WAN_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
        "i2v",
        1,
        "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
        (720, 1280, 81),
    ),
    "wan2.2-i2v-a14b": (
        "wan",
        "wan",
        {**WAN_14B, "in_channels": 36},
        "i2v",
        2,
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers (transformer/ and transformer_2/: one config each)",
        (720, 1280, 81),
    ),
    "wan2.2-ti2v-5b": (
        "wan",
        "wan2.2-5b",
        {
            **WAN_14B,
            "num_attention_heads": 24,
            "in_channels": 48,
            "out_channels": 48,
            "ffn_dim": 14336,
            "num_layers": 30,
        },
        "ti2v",
        1,
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        (704, 1280, 121),
    ),
}
# the edit built-ins that take several condition images a row (QwenImageEditPlusPipeline): the most
CONDITION_IMAGES = {"qwen-image-edit-2509": 3, "qwen-image-edit-2511": 3}
