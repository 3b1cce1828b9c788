"""Tiny LTX-Video, LTX-2 (audio + video) and MiniMax-H3 (packed text | video | audio) transformers and inputs.

LTX and LTX-2 take patchified tokens (patch size 1): ``frames * H * W`` video tokens for latent ``image_hw``.
MiniMax-H3 takes ``(1, 2, 2)``-patchified video rows: ``frames * (H / 2) * (W / 2)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .specs import InputRequest, TinyKind, accepted_config, register, text_mask


def _mask(batch: int, text_len: int, g: torch.Generator, ragged: bool) -> torch.Tensor:
    # LTX's masks are multiplicative 0/1 (the model turns them into an additive bias)
    mask = text_mask(batch, text_len, g) if ragged else torch.ones(batch, text_len, dtype=torch.bool)
    return mask.long()


def _video_timestep(t: torch.Tensor, tokens: int, per_token: bool) -> torch.Tensor:
    # the image-to-video pipelines pass [B, N]: conditioning tokens at another noise level than the rest
    return t[:, None] * torch.linspace(0.5, 1.0, tokens)[None, :] if per_token else t


def _ltx_config() -> dict[str, Any]:
    return dict(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=16,
        cross_attention_dim=64,
        num_layers=2,
        caption_channels=32,
    )


def _ltx_inputs(model: torch.nn.Module, r: InputRequest, per_token_timestep: bool = False) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, ragged_text = r
    cfg = model.config
    tokens = frames * image_hw[0] * image_hw[1]
    return dict(
        hidden_states=torch.randn(batch, tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.caption_channels, generator=g),
        timestep=_video_timestep(t, tokens, per_token_timestep),
        encoder_attention_mask=_mask(batch, text_len, g, ragged_text),
        num_frames=frames,
        height=image_hw[0],
        width=image_hw[1],
        rope_interpolation_scale=(1.0, 1.0, 1.0),
    )


def _ltx2_config() -> dict[str, Any]:
    # video 4 x 16, audio 4 x 8; the a2v / v2a cross-attentions run in the audio width. Keys a version's
    # constructor lacks (0.37 predates the LTX-2.3 options) are dropped.
    return accepted_config(
        "ltx2",
        dict(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=16,
            cross_attention_dim=64,
            audio_in_channels=8,
            audio_out_channels=8,
            audio_num_attention_heads=4,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=32,
            num_layers=2,
            caption_channels=32,
            rope_type="interleaved",
        ),
    )


def _ltx2_inputs(
    model: torch.nn.Module, r: InputRequest, per_token_timestep: bool = False, audio_len: int = 6
) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, ragged_text = r
    cfg = model.config
    tokens = frames * image_hw[0] * image_hw[1]
    return dict(
        hidden_states=torch.randn(batch, tokens, cfg.in_channels, generator=g),
        audio_hidden_states=torch.randn(batch, audio_len, cfg.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.caption_channels, generator=g),
        audio_encoder_hidden_states=torch.randn(batch, text_len, cfg.caption_channels, generator=g),
        timestep=_video_timestep(t, tokens, per_token_timestep),
        audio_timestep=t,
        encoder_attention_mask=_mask(batch, text_len, g, ragged_text),
        audio_encoder_attention_mask=_mask(batch, text_len, g, ragged_text),
        num_frames=frames,
        height=image_hw[0],
        width=image_hw[1],
        fps=24.0,
        audio_num_frames=audio_len,
    )


def _minimax_h3_config() -> dict[str, Any]:
    # rotary over 2 * 3 * rope_freq_dim = 12 of the 16 head channels
    return dict(
        num_attention_heads=4,
        attention_head_dim=16,
        hidden_size=64,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=64,
        in_channels=4,
        audio_in_channels=8,
        patch_size=(1, 2, 2),
        text_dim=32,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=32,
        rope_freq_dim=2,
    )


def _minimax_h3_inputs(model: torch.nn.Module, r: InputRequest, audio_len: int = 6) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, _ = r
    cfg = model.config
    # One packed document [text | video | audio] shared by the batch rows (position_ids is (S, 3)): text at a
    # clean level (timestep 0), video and audio at one noise level, as a text-to-video+audio request packs it.
    p_t, p_h, p_w = cfg.patch_size
    hh, ww = image_hw[0] // p_h, image_hw[1] // p_w
    nt, nv, na = text_len, frames * hh * ww, audio_len
    s = nt + nv + na
    tags = torch.cat(
        [torch.ones(nt), torch.zeros(nv), torch.full((na,), 2.0)]
    ).long()  # 0 video 1 text 2 audio
    pos = torch.zeros(s, 3)
    pos[:nt, 0] = torch.arange(nt)
    vt, vh, vw = torch.meshgrid(torch.arange(frames), torch.arange(hh), torch.arange(ww), indexing="ij")
    pos[nt : nt + nv] = torch.stack([vt.flatten() + nt, vh.flatten(), vw.flatten()], -1).float()
    pos[nt + nv :, 0] = torch.arange(na) + nt
    return dict(
        hidden_states=torch.randn(batch, nv, cfg.in_channels * p_t * p_h * p_w, generator=g),
        audio_hidden_states=torch.randn(batch, na, cfg.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, nt, cfg.text_dim, generator=g),
        timestep=torch.stack([torch.zeros(()), t[0] / 1000.0]),  # the distinct levels, in [0, 1]
        timestep_indices=torch.cat([torch.zeros(nt), torch.ones(nv + na)]).long(),
        token_tags=tags,
        position_ids=pos.long(),
        video_indices=torch.arange(nt, nt + nv),
        audio_indices=torch.arange(nt + nv, s),
        text_indices=torch.arange(nt),
    )


register("ltx", TinyKind(_ltx_config, _ltx_inputs, ("per_token_timestep",)))
register("ltx2", TinyKind(_ltx2_config, _ltx2_inputs, ("per_token_timestep", "audio_len")))
register("minimax_h3", TinyKind(_minimax_h3_config, _minimax_h3_inputs, ("audio_len",)))
