"""Tiny diffusers pipelines written with ``save_pretrained``: the real loading paths, nothing downloaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ._registry import tiny_model

__all__ = ["save_tiny_sd3_pipeline"]


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
