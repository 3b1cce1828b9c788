"""Tiny text-to-image transformers (Qwen-Image, Flux, SD3) and inputs that fit them."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..compat import diffusers_version
from ._registry import TinyKind, register, text_mask


def _qwenimage_config() -> dict[str, Any]:
    return dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def _qwenimage_inputs(
    model: torch.nn.Module,
    g: torch.Generator,
    t: torch.Tensor,
    batch: int,
    text_len: int,
    image_hw: tuple[int, int],
    frames: int,
    ragged_text: bool,
) -> dict[str, Any]:
    cfg = model.config
    h, w = image_hw[0] // cfg.patch_size, image_hw[1] // cfg.patch_size
    inputs: dict[str, Any] = dict(
        hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
        timestep=t / 1000.0,
        img_shapes=[[(1, h, w)]] * batch,
    )
    mask = text_mask(batch, text_len, g) if ragged_text else torch.ones(batch, text_len, dtype=torch.bool)
    inputs["encoder_hidden_states_mask"] = mask
    params = inspect.signature(type(model).forward).parameters
    if "txt_seq_lens" in params and diffusers_version().release < (0, 37):
        # 0.36 sizes the text RoPE from txt_seq_lens (and ignores the mask): use the padded length.
        inputs["txt_seq_lens"] = [text_len] * batch
    return inputs


def _flux_config() -> dict[str, Any]:
    return dict(
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


def _flux_inputs(
    model: torch.nn.Module,
    g: torch.Generator,
    t: torch.Tensor,
    batch: int,
    text_len: int,
    image_hw: tuple[int, int],
    frames: int,
    ragged_text: bool,
) -> dict[str, Any]:
    cfg = model.config
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
    return inputs


def _sd3_config() -> dict[str, Any]:
    # SD3.5-style: qk RMS norm and one dual-attention block (the image-only attn2 path)
    return dict(
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


def _sd3_inputs(
    model: torch.nn.Module,
    g: torch.Generator,
    t: torch.Tensor,
    batch: int,
    text_len: int,
    image_hw: tuple[int, int],
    frames: int,
    ragged_text: bool,
) -> dict[str, Any]:
    cfg = model.config
    # SD3 has no text mask of its own: with ragged_text the padded keys are masked through
    # joint_attention_kwargs, which sp_diffusers' SD3 processor honours (diffusers' own ignores it).
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, *image_hw, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        timestep=t,
    )
    if ragged_text:
        inputs["joint_attention_kwargs"] = {"encoder_hidden_states_mask": text_mask(batch, text_len, g)}
    return inputs


register("qwenimage", TinyKind(_qwenimage_config, _qwenimage_inputs))
register("flux", TinyKind(_flux_config, _flux_inputs))
register("sd3", TinyKind(_sd3_config, _sd3_inputs))
