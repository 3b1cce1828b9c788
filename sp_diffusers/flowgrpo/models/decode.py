"""Final latents -> pixels in [0, 1] with a pipeline's own VAE, as the family's pipeline decodes them.

Each adapter says how its latents reach the VAE (``adapter.vae_latents``: Qwen-Image and Flux unpack 2 x 2 tokens,
SD3 and Wan pass them as they are) and how the decoded tensor is laid out for rewards (``adapter.pixel_layout``:
``[b, 3, H, W]``, video ``[b, F, 3, H, W]``). The VAE's own config says how the latents were normalised:
``latents_mean`` / ``latents_std`` (Qwen-Image's and Wan's VAEs: ``z * std + mean``) or ``scaling_factor`` /
``shift_factor`` (SD3's and Flux's: ``z / scaling + shift``), exactly as the pipelines undo it before ``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import FamilyAdapter

__all__ = ["PackedTokens", "PixelDecoder", "denormalize", "unpack_2x2"]


def unpack_2x2(tokens: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Packed tokens ``[B, h w, 4 C]`` -> latents ``[B, C, 2h, 2w]`` (the inverse of the Qwen-Image / Flux
    pipelines' ``_pack_latents``: each token holds a 2 x 2 patch, channel-major)."""
    b, n, c4 = tokens.shape
    if n != grid_h * grid_w or c4 % 4:
        raise ValueError(f"unpack_2x2: tokens of shape {tuple(tokens.shape)} do not fill a {grid_h} x {grid_w} grid of 2x2 patches")
    x = tokens.reshape(b, grid_h, grid_w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 2 * grid_h, 2 * grid_w)


@dataclass(frozen=True)
class PackedTokens(FamilyAdapter):
    """The latent geometry Qwen-Image and FLUX.1 share: each 2 x 2 patch of the VAE latents is one token,
    ``[B, grid_h * grid_w, channels]``; the rewards read the tokens as they are."""

    grid_h: int
    grid_w: int
    channels: int

    @property
    def tokens(self) -> int:
        return self.grid_h * self.grid_w

    def latent_shape(self, batch: int) -> tuple[int, int, int]:
        return (batch, self.tokens, self.channels)

    def reward_view(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as ``[B, L, C]`` tokens (what the built-in rewards read)."""
        return latents


def denormalize(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The pipeline's latents -> the VAE's latent scale (what ``vae.decode`` takes)."""
    cfg = vae.config
    mean = getattr(cfg, "latents_mean", None)
    if mean is not None:
        shape = (1, len(mean)) + (1,) * (z.ndim - 2)
        m = torch.tensor(mean, dtype=z.dtype, device=z.device).view(shape)
        s = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(shape)
        return z * s + m
    shift = getattr(cfg, "shift_factor", None) or 0.0
    return z / cfg.scaling_factor + shift


class PixelDecoder:
    """``decoder(latents [b, ...]) -> pixels`` float32 in [0, 1] (``[b, 3, H, W]`` or ``[b, F, 3, H, W]``), decoding
    ``chunk`` samples at a time on ``device`` in the VAE's dtype (a video VAE's activations are large)."""

    def __init__(self, vae: torch.nn.Module, adapter: Any, device: torch.device | str, chunk: int = 1) -> None:
        self.vae = vae.to(device).eval().requires_grad_(False)
        self.adapter, self.device, self.chunk = adapter, torch.device(device), max(1, int(chunk))
        self.dtype = next(self.vae.parameters()).dtype

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        out = []
        for part in latents.split(self.chunk):
            z = self.adapter.vae_latents(part).to(self.device, self.dtype)
            x = self.vae.decode(denormalize(self.vae, z), return_dict=False)[0]
            out.append(self.adapter.pixel_layout((x.float() / 2 + 0.5).clamp(0, 1)))
        return torch.cat(out)
