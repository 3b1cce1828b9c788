"""Tiny text-to-video transformers (Wan, HunyuanVideo, HunyuanVideo-1.5, CogVideoX) and inputs that fit them."""

from __future__ import annotations

from typing import Any

import torch

from .specs import InputRequest, TinyKind, register, text_mask


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


def wan_config() -> dict[str, Any]:
    return dict(
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


def _wan_inputs(
    model: torch.nn.Module, r: InputRequest, first_frame_timestep: bool = False, clip_tokens: int = 5
) -> dict[str, Any]:
    """Image-to-video follows the config: ``in_channels`` holds the condition channels (Wan I2V), ``image_dim`` adds
    ``clip_tokens`` CLIP image tokens (Wan2.1 I2V: 257); ``first_frame_timestep``: Wan2.2 TI2V's per-token timesteps ``[B, N]``, 0 on the first latent
    frame."""
    g, t, batch, text_len, image_hw, frames, _ = r
    cfg = model.config
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
        timestep=t,
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_dim, generator=g),
    )
    if cfg.image_dim is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, clip_tokens, cfg.image_dim, generator=g)
    if first_frame_timestep:
        pt, ph, pw = cfg.patch_size
        per_frame = (image_hw[0] // ph) * (image_hw[1] // pw)
        mask = torch.ones(frames // pt, per_frame)
        mask[0] = 0
        inputs["timestep"] = t[:, None] * mask.flatten()[None, :]
    return inputs


def _hunyuanvideo_config() -> dict[str, Any]:
    # one dual-stream, one single-stream and one token-refiner block; RoPE axes (t, h, w) sum to the head dim
    return dict(
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


def _hunyuanvideo_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, ragged_text = r
    cfg = model.config
    # [B, C, F, H, W] latents; the (ragged) text mask is the model's own encoder_attention_mask
    mask = text_mask(batch, text_len, g) if ragged_text else torch.ones(batch, text_len, dtype=torch.bool)
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
        timestep=t,
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_embed_dim, generator=g),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
    )
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 6000.0)  # guidance scale x 1000, as the pipeline passes it
    if cfg.image_condition_type == "latent_concat":
        cond = torch.randn(batch, cfg.in_channels // 2, frames, *image_hw, generator=g)
        inputs["hidden_states"] = torch.cat([inputs["hidden_states"][:, : cfg.in_channels // 2], cond], 1)
    return inputs


def _hunyuanvideo15_config() -> dict[str, Any]:
    # text-to-video: latent (4) + condition latent (4) + mask (1) channels, as the 1.5 checkpoints pack them;
    # the byT5 projection's 2048 width is fixed by diffusers (most of this tiny model's parameters)
    return dict(
        in_channels=9,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=32,
        text_embed_2_dim=16,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    )


def _hunyuanvideo15_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, ragged_text = r
    cfg = model.config
    # three context streams, each with its own key mask: the MLLM prompt, the byT5 glyph prompt and the image
    # tokens (all-zero image embeds are how the pipeline says text-to-video: their mask is then all False)
    text_len_2 = max(2, text_len // 2)
    masks = [
        text_mask(batch, n, g) if ragged_text else torch.ones(batch, n, dtype=torch.bool)
        for n in (text_len, text_len_2)
    ]
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *image_hw, generator=g),
        timestep=t,
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_embed_dim, generator=g),
        encoder_attention_mask=masks[0].long(),
        encoder_hidden_states_2=torch.randn(batch, text_len_2, cfg.text_embed_2_dim, generator=g),
        encoder_attention_mask_2=masks[1].long(),
        image_embeds=torch.zeros(batch, 3, cfg.image_embed_dim),
    )


def _cogvideox_config() -> dict[str, Any]:
    # CogVideoX-1.5-style: RoPE given as an input (no sincos positions), temporal patches of 2 frames
    return dict(
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


def _cogvideox_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, frames, ragged_text = r
    cfg = model.config
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
        inputs["attention_kwargs"] = {"encoder_hidden_states_mask": text_mask(batch, text_len, g)}
    return inputs


register("wan", TinyKind(wan_config, _wan_inputs, ("first_frame_timestep", "clip_tokens")))
register("hunyuanvideo", TinyKind(_hunyuanvideo_config, _hunyuanvideo_inputs))
register("cogvideox", TinyKind(_cogvideox_config, _cogvideox_inputs))
register("hunyuanvideo15", TinyKind(_hunyuanvideo15_config, _hunyuanvideo15_inputs))
