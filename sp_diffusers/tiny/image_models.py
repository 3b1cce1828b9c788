"""Tiny text-to-image transformers (Qwen-Image, Flux, Flux.2, SD3, Z-Image) and inputs that fit them."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..patching.compat import diffusers_version
from .specs import InputRequest, TinyKind, accepted_config, register, text_mask


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
    model: torch.nn.Module, r: InputRequest, condition_hw: tuple[tuple[int, int], ...] = ()
) -> dict[str, Any]:
    """``condition_hw``: the latent (H, W) of each condition image (Qwen-Image-Edit: their packed tokens follow the
    noisy ones in ``hidden_states``, each its own entry of ``img_shapes``)."""
    g, t, batch, text_len, image_hw, _, ragged_text = r
    cfg = model.config
    h, w = image_hw[0] // cfg.patch_size, image_hw[1] // cfg.patch_size
    grids = [(1, h, w), *((1, ch // cfg.patch_size, cw // cfg.patch_size) for ch, cw in condition_hw)]
    tokens = sum(gh * gw for _, gh, gw in grids)
    inputs: dict[str, Any] = dict(
        hidden_states=torch.randn(batch, tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
        timestep=t / 1000.0,
        img_shapes=[grids] * batch,
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
    model: torch.nn.Module, r: InputRequest, condition_hw: tuple[tuple[int, int], ...] = ()
) -> dict[str, Any]:
    """``condition_hw``: the packed grid of a condition image (FLUX.1 Kontext: its tokens follow the noisy ones, ids
    ``(1, row, column)``)."""
    g, t, batch, text_len, image_hw, _, _ = r
    cfg = model.config

    def ids(h: int, w: int, first: float) -> torch.Tensor:
        out = torch.full((h, w, 3), first)
        out[..., 1] = torch.arange(h)[:, None]
        out[..., 2] = torch.arange(w)[None, :]
        return out.reshape(h * w, 3)

    h, w = image_hw
    img_ids = torch.cat([ids(h, w, 0.0), *(ids(ch, cw, 1.0) for ch, cw in condition_hw)])
    inputs = dict(
        hidden_states=torch.randn(batch, img_ids.shape[0], cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        timestep=t / 1000.0,
        img_ids=img_ids,
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


def _sd3_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, _, ragged_text = r
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


def _flux2_config() -> dict[str, Any]:
    # Flux.2: a 4-axis RoPE over (t, h, w, l) ids whose dims sum to the head dim; 0.36 has no guidance_embeds
    return accepted_config(
        "flux2",
        dict(
            patch_size=1,
            in_channels=16,
            out_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            timestep_guidance_channels=32,
            mlp_ratio=2.0,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=True,
        ),
    )


def _flux2_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, _, _ = r
    cfg = model.config
    h, w = image_hw
    img_ids = torch.zeros(h, w, 4)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    txt_ids = torch.zeros(text_len, 4)
    txt_ids[:, 3] = torch.arange(text_len)
    # Flux.2's ids carry the batch dim ([B, S, 4]): that is what its plan splits (dim 1, 3-D)
    inputs: dict[str, Any] = dict(
        hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
        timestep=t / 1000.0,
        img_ids=img_ids.reshape(1, h * w, 4).expand(batch, -1, -1).contiguous(),
        txt_ids=txt_ids[None].expand(batch, -1, -1).contiguous(),
    )
    if getattr(cfg, "guidance_embeds", True):
        inputs["guidance"] = torch.full((batch,), 4.0)
    return inputs


def _zimage_config() -> dict[str, Any]:
    # single-stream S3-DiT; axes_dims sum to the head dim; one refiner layer per stream
    return dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32],
    )


def _zimage_inputs(model: torch.nn.Module, r: InputRequest) -> dict[str, Any]:
    g, t, batch, text_len, image_hw, _, ragged_text = r
    cfg = model.config
    # Per-sample lists: latents [C, 1, H, W] and captions [L_i, cap_feat_dim]. The model pads every item to a
    # multiple of 32 tokens itself; a ragged batch gives samples of different padded lengths (and so the batch
    # key mask) only where a caption crosses a multiple of 32, hence a longer first caption.
    lengths = [text_len] * batch
    if ragged_text:
        lengths = [text_len + 32, *text_mask(batch, text_len, g)[1:].sum(1).tolist()]
    return dict(
        x=[torch.randn(cfg.in_channels, 1, *image_hw, generator=g) for _ in range(batch)],
        t=t / 1000.0,
        cap_feats=[torch.randn(int(n), cfg.cap_feat_dim, generator=g) for n in lengths],
        patch_size=cfg.all_patch_size[0],
        f_patch_size=cfg.all_f_patch_size[0],
    )


register("qwenimage", TinyKind(_qwenimage_config, _qwenimage_inputs, ("condition_hw",)))
register("flux", TinyKind(_flux_config, _flux_inputs, ("condition_hw",)))
register("sd3", TinyKind(_sd3_config, _sd3_inputs))
register("flux2", TinyKind(_flux2_config, _flux2_inputs))
register("zimage", TinyKind(_zimage_config, _zimage_inputs))
