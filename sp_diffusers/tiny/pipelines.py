"""Tiny diffusers pipelines written with ``save_pretrained``: the real loading paths, nothing downloaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..scheduler_configs import scheduler_kwargs
from ._registry import tiny_model

__all__ = ["WAN_SCHEDULER_CONFIG", "save_tiny_sd3_pipeline", "save_tiny_wan_pipeline", "tiny_umt5"]

# Wan2.1-T2V-1.3B-Diffusers' scheduler_config.json (UniPC, flow sigmas, flow_shift 3)
WAN_SCHEDULER_CONFIG = scheduler_kwargs("wan")


def save_tiny_sd3_pipeline(folder: str | os.PathLike, seed: int = 0, **transformer_overrides: Any) -> Path:
    """Write a tiny ``StableDiffusion3Pipeline`` (no VAE) to ``folder`` and return it.

    Real classes with small configs: the tiny SD3 transformer, two ``CLIPTextModelWithProjection`` (16 wide,
    pooled 16 + 16 = the transformer's pooled_projection_dim), a ``T5EncoderModel`` (32 = its
    joint_attention_dim) and character-level tokenizers, so ``PipelineTextEncoder`` and the
    ``from_pretrained`` paths run exactly as with stable-diffusion-3.5, with nothing downloaded.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
    )

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)]

    def tokenizer(max_length: int) -> PreTrainedTokenizerFast:
        raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
        return PreTrainedTokenizerFast(
            tokenizer_object=raw,
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            model_max_length=max_length,
        )

    def clip() -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(words),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                projection_dim=16,
                max_position_embeddings=77,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder, text_encoder_2 = clip(), clip()
        text_encoder_3 = T5EncoderModel(
            T5Config(
                vocab_size=len(words),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=1,
                num_heads=2,
                pad_token_id=0,
                eos_token_id=2,
            )
        )
    pipe = StableDiffusion3Pipeline(
        transformer=tiny_model("sd3", seed=seed, **transformer_overrides),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer(77),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer(77),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer(512),
    )
    pipe.save_pretrained(folder)
    return Path(folder)


def tiny_umt5(seed: int = 1234, d_model: int = 32, num_layers: int = 2):
    """``(ByT5Tokenizer, UMT5EncoderModel)``: Wan's text-encoder class, tiny and random (same seed, same weights),
    over ByT5's byte vocabulary (a pure-python tokenizer that needs no files, so nothing is downloaded)."""
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=num_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = UMT5EncoderModel(config)
    return tokenizer, encoder.eval()


def save_tiny_wan_pipeline(folder: str | os.PathLike, seed: int = 0, **transformer_overrides: Any) -> Path:
    """Write a tiny ``WanPipeline`` to ``folder`` and return it.

    Real classes with small configs: the tiny ``WanTransformer3DModel`` (text_dim 32), a ``UMT5EncoderModel``
    (d_model 32) with a ``ByT5Tokenizer``, a tiny ``AutoencoderKLWan`` (z_dim = the transformer's channels; the
    trainer never decodes, but ``WanPipeline.from_pretrained`` wants one) and Wan2.1's own
    ``UniPCMultistepScheduler`` config (flow sigmas, flow_shift 3), so ``PipelineTextEncoder``, the pipeline
    schedule and the ``from_pretrained`` paths run as with Wan2.1-T2V-1.3B-Diffusers, with nothing downloaded.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    transformer = tiny_model("wan", seed=seed, **transformer_overrides)
    tokenizer, text_encoder = tiny_umt5(seed=seed + 1, d_model=transformer.config.text_dim)
    z = transformer.config.in_channels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=z,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * z,
            latents_std=[1.0] * z,
        )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        transformer=transformer,
    )
    pipe.save_pretrained(folder)
    return Path(folder)
