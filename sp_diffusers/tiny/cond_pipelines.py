"""Tiny image-conditioned pipelines written with ``save_pretrained`` (editing and image-to-video), nothing downloaded.

Each holds the classes its released checkpoint holds, small and seeded (``text_parts.py``, ``vision_parts.py``):

| family | pipeline | transformer | condition |
|---|---|---|---|
| ``flux-kontext`` | ``FluxKontextPipeline`` | Flux (guidance embedding) | VAE latents packed beside the noisy ones |
| ``qwenimage-edit`` | ``QwenImageEditPipeline`` | Qwen-Image | VAE latents beside the noisy ones; the prompt read with the image by Qwen2.5-VL |
| ``qwenimage-edit-plus`` | ``QwenImageEditPlusPipeline`` | Qwen-Image (``zero_cond_t``, as 2511) | several images' latents |
| ``wan-i2v`` | ``WanImageToVideoPipeline`` | Wan, 4 + z channels more in, CLIP image tokens | first frame + mask as channels |
| ``wan2.2-i2v`` | ``WanImageToVideoPipeline`` | two Wan experts (``boundary_ratio`` 0.9), no CLIP | as ``wan-i2v`` |
| ``wan2.2-ti2v`` | ``WanImageToVideoPipeline`` (``expand_timesteps``) | Wan | first latent frame replaced, per-token timesteps |

The edit families compress 8x (their pipelines resize the condition image to about 1 MP whatever the output size);
the Wan ones 4x in space and time (the VAE encodes a first frame and chunks of 4; the condition is the first frame at
the output size).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..families.scheduler_configs import scheduler_kwargs
from .specs import tiny_model
from .text_parts import (
    flux_parts,
    save_pipeline,
    tiny_qwenimage_vae,
    tiny_umt5,
    tiny_wan_vae,
)
from .vision_parts import tiny_clip_vision, tiny_qwen25vl_vision, tiny_qwen_vl_processor

__all__ = [
    "COND_PIPELINE_WRITERS",
    "save_tiny_flux_kontext_pipeline",
    "save_tiny_qwenimage_edit_pipeline",
    "save_tiny_wan_i2v_pipeline",
]


def save_tiny_flux_kontext_pipeline(
    folder: str | os.PathLike, seed: int = 0, **transformer_overrides: Any
) -> Path:
    """A tiny ``FluxKontextPipeline``: the tiny FLUX.1 transformer with a guidance embedding (Kontext-dev is
    guidance-distilled), CLIP + T5 as ``FluxPipeline``'s, an 8x ``AutoencoderKL`` and FLUX.1's scheduler config."""
    from diffusers import FluxKontextPipeline

    transformer = tiny_model("flux", seed=seed, guidance_embeds=True, **transformer_overrides)
    return save_pipeline(FluxKontextPipeline(transformer=transformer, **flux_parts(seed, transformer, vae_factor=8)), folder)


def save_tiny_qwenimage_edit_pipeline(
    folder: str | os.PathLike, seed: int = 0, plus: bool = False, **transformer_overrides: Any
) -> Path:
    """A tiny ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``, several condition images, its
    transformer with ``zero_cond_t`` as Qwen-Image-Edit-2511's): the tiny Qwen-Image transformer, Qwen2.5-VL reading
    the prompt and the image (``vision_parts``), an 8x ``AutoencoderKLQwenImage``, Qwen-Image's scheduler config.

    The processor is written as its parts (tokenizer, image processor): transformers >= 5 builds a
    ``Qwen2VLProcessor`` only with a video processor, which needs torchvision (see ``models/qwen_processor.py``)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .vision_parts import save_qwen_vl_processor

    if plus:
        transformer_overrides.setdefault("zero_cond_t", True)
    transformer = tiny_model("qwenimage", seed=seed, **transformer_overrides)
    processor = tiny_qwen_vl_processor()
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    pipe = cls(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("qwenimage")),
        vae=tiny_qwenimage_vae(seed + 2, transformer.config.in_channels // 4, factor=8),
        text_encoder=tiny_qwen25vl_vision(seed + 1, transformer.config.joint_attention_dim),
        tokenizer=processor.tokenizer,
        processor=processor,
        transformer=transformer,
    )
    pipe.processor = None  # written by hand below (the folder keeps the component's name and class)
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    path = save_pipeline(pipe, folder)
    save_qwen_vl_processor(processor, path / "processor")
    return path


def save_tiny_wan_i2v_pipeline(
    folder: str | os.PathLike,
    seed: int = 0,
    variant: str = "wan2.1",
    **transformer_overrides: Any,
) -> Path:
    """A tiny ``WanImageToVideoPipeline`` of ``variant``:

    - ``wan2.1`` (I2V-14B): one transformer taking the noisy latents, the mask (the VAE's temporal factor, 4, in
      channels) and the first frame's latents as channels, and CLIP image tokens (``image_dim``; a tiny
      ``CLIPVisionModel`` + ``CLIPImageProcessor``);
    - ``wan2.2`` (I2V-A14B): two such experts (``boundary_ratio`` 0.9), no CLIP;
    - ``wan2.2-ti2v`` (TI2V-5B): ``expand_timesteps``: the first latent frame is the image's, with timestep 0.
    UMT5 + ByT5 tokenizer, a 4x / 4x ``AutoencoderKLWan`` and Wan2.1's scheduler config as ``save_tiny_wan_pipeline``."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    if variant not in ("wan2.1", "wan2.2", "wan2.2-ti2v"):
        raise ValueError(
            f"variant={variant!r}: choose wan2.1 (I2V), wan2.2 (I2V-A14B) or wan2.2-ti2v (TI2V-5B)"
        )
    z, mask_channels = 4, 4  # tiny_wan_vae(factor=4): z channels; its temporal factor is the mask's channel count
    extra: dict[str, Any] = {}
    if variant == "wan2.2-ti2v":
        config = dict(in_channels=z, out_channels=z)
        extra["expand_timesteps"] = True
    else:
        config = dict(in_channels=2 * z + mask_channels, out_channels=z)
    if variant == "wan2.1":
        processor, encoder = tiny_clip_vision(seed + 3)
        config.update(image_dim=encoder.config.hidden_size, added_kv_proj_dim=64)
        extra.update(image_processor=processor, image_encoder=encoder)
    config.update(transformer_overrides)
    transformer = tiny_model("wan", seed=seed, **config)
    if variant == "wan2.2":
        extra.update(transformer_2=tiny_model("wan", seed=seed + 10, **config), boundary_ratio=0.9)
    tokenizer, text_encoder = tiny_umt5(seed=seed + 1, d_model=transformer.config.text_dim)
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=tiny_wan_vae(seed + 2, z, factor=4),
        scheduler=UniPCMultistepScheduler(**scheduler_kwargs("wan")),
        transformer=transformer,
        **extra,
    )
    return save_pipeline(pipe, folder)


# family -> (writer, options): the image-conditioned families the trainer reads from a pipeline folder
COND_PIPELINE_WRITERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "flux-kontext": (save_tiny_flux_kontext_pipeline, {}),
    "qwenimage-edit": (save_tiny_qwenimage_edit_pipeline, {}),
    "qwenimage-edit-plus": (save_tiny_qwenimage_edit_pipeline, {"plus": True}),
    "wan-i2v": (save_tiny_wan_i2v_pipeline, {"variant": "wan2.1"}),
    "wan2.2-i2v": (save_tiny_wan_i2v_pipeline, {"variant": "wan2.2"}),
    "wan2.2-ti2v": (save_tiny_wan_i2v_pipeline, {"variant": "wan2.2-ti2v"}),
}
