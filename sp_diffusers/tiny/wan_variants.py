"""Tiny transformers of the Wan family besides Wan itself (ChronoEdit, Wan-VACE, Helios) and inputs that fit them.

All take ``[B, C, F, H, W]`` latents with ``(1, 2, 2)`` patches: ``frames * (H / 2) * (W / 2)`` video tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from .specs import InputRequest, TinyKind, register
from .video_models import wan_config


def _wan_like(**extra: Any) -> dict[str, Any]:
    """The tiny Wan config (without its RoPE length) and each variant's own keys."""
    return {**{k: v for k, v in wan_config().items() if k != "rope_max_seq_len"}, **extra}


def _chronoedit_config() -> dict[str, Any]:
    # Wan-2.1-I2V-shaped: CLIP image tokens through image_dim, added K/V in the cross-attention
    return _wan_like(image_dim=16, added_kv_proj_dim=64, rope_max_seq_len=32, rope_temporal_skip_len=8)


def _chronoedit_inputs(
    model: torch.nn.Module, r: InputRequest, per_token_timestep: bool = False
) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, _ = r
    cfg = model.config
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
        timestep=t,
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_dim, generator=g),
        encoder_hidden_states_image=torch.randn(batch, 4, cfg.image_dim, generator=g),
    )
    if per_token_timestep:
        # [B, N]: the Wan-2.2-TI2V form ChronoEdit's forward accepts (one timestep per video token)
        tokens = frames * (image_hw[0] // 2) * (image_hw[1] // 2)
        inputs["timestep"] = t[:, None] * torch.linspace(0.5, 1.0, tokens)[None, :]
    return inputs


def _wanvace_config() -> dict[str, Any]:
    # a VACE block before each of the two main blocks; control latents of their own channel count
    return _wan_like(rope_max_seq_len=32, vace_layers=[0, 1], vace_in_channels=8)


def _wanvace_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, _ = r
    cfg = model.config
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
        timestep=t,
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_dim, generator=g),
        control_hidden_states=torch.randn(batch, cfg.vace_in_channels, frames, *image_hw, generator=g),
        control_hidden_states_scale=torch.linspace(0.5, 1.0, len(cfg.vace_layers)),
    )


def _helios_config() -> dict[str, Any]:
    # rope_dim (t, y, x) sums to the head dim; guidance_cross_attn (the default) splits the history tokens off
    # before the cross-attention; the multi-term memory patches embed short / mid / long history latents;
    # is_amplify_history scales the history keys in the self-attention
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_dim=(4, 6, 6),
        guidance_cross_attn=True,
        zero_history_timestep=True,
        has_multi_term_memory_patch=True,
        is_amplify_history=True,
    )


def _helios_inputs(model: torch.nn.Module, r: InputRequest, history: bool = True) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, _ = r
    cfg = model.config
    inputs: dict[str, Any] = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
        timestep=t,
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_dim, generator=g),
    )
    if history:
        # the pipeline's layout: long (oldest), mid and short history frames, then the current chunk. The history
        # tokens come first in the sequence, so at SP = 4 the first shards hold history tokens only.
        n_long, n_mid, n_short = 4, 2, 1
        idx = torch.arange(n_long + n_mid + n_short + frames)
        inputs.update(
            indices_hidden_states=idx[-frames:][None].expand(batch, -1),
            indices_latents_history_short=idx[n_long + n_mid : n_long + n_mid + n_short][None].expand(
                batch, -1
            ),
            indices_latents_history_mid=idx[n_long : n_long + n_mid][None].expand(batch, -1),
            indices_latents_history_long=idx[:n_long][None].expand(batch, -1),
            latents_history_short=torch.randn(batch, cfg.in_channels, n_short, *image_hw, generator=g),
            latents_history_mid=torch.randn(batch, cfg.in_channels, n_mid, *image_hw, generator=g),
            latents_history_long=torch.randn(batch, cfg.in_channels, n_long, *image_hw, generator=g),
        )
    return inputs


register("chronoedit", TinyKind(_chronoedit_config, _chronoedit_inputs, ("per_token_timestep",)))
register("wanvace", TinyKind(_wanvace_config, _wanvace_inputs))
register("helios", TinyKind(_helios_config, _helios_inputs, ("history",)))
