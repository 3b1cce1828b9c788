"""Tiny models from real diffusers classes with small configs, and inputs that fit them.

For the embedded default (demo, trainer), the tests and the benchmarks: no weights are downloaded.
Every model here has a context-parallel plan in every supported diffusers version; token counts are
multiples of 4 so Ulysses degrees 1, 2 and 4 all divide them.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch

from .compat import diffusers_version
from .model_kinds import KINDS, model_class

TINY_MODELS = tuple(KINDS)

__all__ = ["TINY_MODELS", "save_tiny_sd3_pipeline", "tiny_inputs", "tiny_model", "tiny_model_config"]


def tiny_model_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """The constructor kwargs of the tiny ``kind`` model (``overrides`` replace defaults)."""
    if kind == "qwenimage":
        config = dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
    elif kind == "flux":
        config = dict(
            patch_size=1,
            in_channels=16,
            out_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6),
        )
    elif kind == "wan":
        config = dict(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_max_seq_len=32,
        )
    elif kind == "sd3":
        # SD3.5-style: qk RMS norm and one dual-attention block (the image-only attn2 path)
        config = dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            caption_projection_dim=64,
            pooled_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        )
    elif kind == "hunyuanvideo":
        # one dual-stream, one single-stream and one token-refiner block; RoPE axes (t, h, w) sum to the head dim
        config = dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=32,
            pooled_projection_dim=16,
            rope_axes_dim=(4, 6, 6),
        )
    elif kind == "cogvideox":
        # CogVideoX-1.5-style: RoPE given as an input (no sincos positions), temporal patches of 2 frames
        config = dict(
            num_attention_heads=4,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            time_embed_dim=32,
            text_embed_dim=32,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=9,
            patch_size=2,
            patch_size_t=2,
            max_text_seq_length=16,
            use_rotary_positional_embeddings=True,
        )
    else:
        raise ValueError(f"kind={kind!r} is not a tiny model; choose one of {TINY_MODELS}")
    config.update(overrides)
    return config


def tiny_model(
    kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> torch.nn.Module:
    """A randomly initialised tiny ``kind`` transformer (identical on every rank for the same seed)."""
    cls = model_class(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**tiny_model_config(kind, **overrides))
        # Some blocks zero-initialise their output projections (adaLN-zero); random weights make every
        # parameter matter for gradient checks.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
    return model if dtype == torch.float32 else model.to(dtype)


def _text_mask(batch: int, text_len: int, generator: torch.Generator) -> torch.Tensor:
    """Ragged bool key-padding mask: the first sample is full, the others shorter (never empty)."""
    lengths = [
        text_len,
        *torch.randint(max(1, text_len // 3), text_len, (batch - 1,), generator=generator).tolist(),
    ]
    return torch.arange(text_len)[None, :] < torch.tensor(lengths)[:, None]


def _cogvideox_rope(cfg: Any, frames: int, image_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX's 3-D RoPE tables ``(cos, sin)``, each ``[N, D]`` (N = video tokens), as its pipeline builds
    them when the latent size equals the base size (no crop)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    h, w = image_hw[0] // cfg.patch_size, image_hw[1] // cfg.patch_size
    t = frames // cfg.patch_size_t if cfg.patch_size_t else frames
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=cfg.attention_head_dim, crops_coords=((0, 0), (h, w)), grid_size=(h, w), temporal_size=t
    )
    return cos, sin


def tiny_inputs(
    kind: str,
    model: torch.nn.Module,
    batch: int = 2,
    seed: int = 0,
    text_len: int = 8,
    image_hw: tuple[int, int] = (8, 8),
    frames: int = 2,
    ragged_text: bool = True,
) -> dict[str, Any]:
    """Forward kwargs for the tiny model (identical on every rank for the same seed).

    ``image_hw`` is the latent height/width before patching; ``text_len`` the (padded) text length.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    t = torch.rand(batch, generator=g) * 1000.0
    if kind == "qwenimage":
        h, w = image_hw[0] // cfg.patch_size, image_hw[1] // cfg.patch_size
        inputs: dict[str, Any] = dict(
            hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=g),
            encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
            timestep=t / 1000.0,
            img_shapes=[[(1, h, w)]] * batch,
        )
        mask = (
            _text_mask(batch, text_len, g) if ragged_text else torch.ones(batch, text_len, dtype=torch.bool)
        )
        inputs["encoder_hidden_states_mask"] = mask
        params = inspect.signature(type(model).forward).parameters
        if "txt_seq_lens" in params and diffusers_version().release < (0, 37):
            # 0.36 sizes the text RoPE from txt_seq_lens (and ignores the mask): use the padded length.
            inputs["txt_seq_lens"] = [text_len] * batch
    elif kind == "flux":
        h, w = image_hw
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        inputs = dict(
            hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=g),
            encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
            pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
            timestep=t / 1000.0,
            img_ids=img_ids.reshape(h * w, 3),
            txt_ids=torch.zeros(text_len, 3),
        )
    elif kind == "wan":
        inputs = dict(
            hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, text_len, cfg.text_dim, generator=g),
        )
    elif kind == "sd3":
        # SD3 has no text mask of its own: with ragged_text the padded keys are masked through
        # joint_attention_kwargs, which sp_diffusers' SD3 processor honours (diffusers' own ignores it).
        inputs = dict(
            hidden_states=torch.randn(batch, cfg.in_channels, *image_hw, generator=g),
            encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
            pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
            timestep=t,
        )
        if ragged_text:
            inputs["joint_attention_kwargs"] = {"encoder_hidden_states_mask": _text_mask(batch, text_len, g)}
    elif kind == "hunyuanvideo":
        # [B, C, F, H, W] latents; the (ragged) text mask is the model's own encoder_attention_mask
        mask = (
            _text_mask(batch, text_len, g) if ragged_text else torch.ones(batch, text_len, dtype=torch.bool)
        )
        inputs = dict(
            hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, text_len, cfg.text_embed_dim, generator=g),
            encoder_attention_mask=mask,
            pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        )
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full(
                (batch,), 6000.0
            )  # guidance scale x 1000, as the pipeline passes it
        if cfg.image_condition_type == "latent_concat":
            cond = torch.randn(batch, cfg.in_channels // 2, frames, *image_hw, generator=g)
            inputs["hidden_states"] = torch.cat([inputs["hidden_states"][:, : cfg.in_channels // 2], cond], 1)
    elif kind == "cogvideox":
        # [B, F, C, H, W] latents; CogVideoX has no text mask (with ragged_text the padded keys are masked
        # through attention_kwargs, which sp_diffusers' CogVideoX processor honours and diffusers' ignores)
        inputs = dict(
            hidden_states=torch.randn(batch, frames, cfg.in_channels, *image_hw, generator=g),
            encoder_hidden_states=torch.randn(batch, text_len, cfg.text_embed_dim, generator=g),
            timestep=t,
        )
        if cfg.use_rotary_positional_embeddings:
            inputs["image_rotary_emb"] = _cogvideox_rope(cfg, frames, image_hw)
        if cfg.ofs_embed_dim:
            inputs["ofs"] = torch.full((batch,), 2.0)
        if ragged_text:
            inputs["attention_kwargs"] = {"encoder_hidden_states_mask": _text_mask(batch, text_len, g)}
    else:
        raise ValueError(f"kind={kind!r} is not a tiny model; choose one of {TINY_MODELS}")
    return {
        k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()
    }


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
