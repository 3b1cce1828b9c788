"""Final latents -> pixels in [0, 1] with a pipeline's own VAE, as the family's pipeline decodes them, and back
(:class:`PixelEncoder`: images of a preference data set into the trainer's latents).

Each adapter says how its latents reach the VAE (``adapter.vae_latents``: Qwen-Image and Flux unpack 2 x 2 tokens,
SD3 and Wan pass them as they are) and how the decoded tensor is laid out for rewards (``adapter.pixel_layout``:
``[b, 3, H, W]``, video ``[b, F, 3, H, W]``). The VAE's own config says how the latents were normalised:
``latents_mean`` / ``latents_std`` (Qwen-Image's and Wan's VAEs: ``z * std + mean``) or ``scaling_factor`` /
``shift_factor`` (SD3's and Flux's: ``z / scaling + shift``; ``latent_scale.py``), exactly as the pipelines undo it before ``decode``
(``adapter.to_vae``; FLUX.2's adapter undoes its VAE's batch-norm statistics over the packed tokens instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import FamilyAdapter

__all__ = [
    "ImageLatents",
    "PackedTokens",
    "PixelDecoder",
    "PixelEncoder",
    "VideoLatents",
    "pack_2x2",
    "unpack_2x2",
]


def unpack_2x2(tokens: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Packed tokens ``[B, h w, 4 C]`` -> latents ``[B, C, 2h, 2w]`` (the inverse of the Qwen-Image / Flux
    pipelines' ``_pack_latents``: each token holds a 2 x 2 patch, channel-major)."""
    b, n, c4 = tokens.shape
    if n != grid_h * grid_w or c4 % 4:
        raise ValueError(f"unpack_2x2: tokens of shape {tuple(tokens.shape)} do not fill a {grid_h} x {grid_w} grid of 2x2 patches")
    x = tokens.reshape(b, grid_h, grid_w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 2 * grid_h, 2 * grid_w)


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[B, C, 2h, 2w]`` -> packed tokens ``[B, h w, 4 C]`` (the pipelines' ``_pack_latents``; the inverse
    of :func:`unpack_2x2`)."""
    b, c, height, width = latents.shape
    if height % 2 or width % 2:
        raise ValueError(f"pack_2x2: latents of shape {tuple(latents.shape)} do not tile into 2x2 patches")
    x = latents.reshape(b, c, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (height // 2) * (width // 2), 4 * c)


@dataclass(frozen=True)
class ImageLatents(FamilyAdapter):
    """The latent geometry SD3 and Z-Image share: ``[B, C, H, W]`` as the VAE takes it (``patch`` x ``patch`` pixels of
    it one token); the rewards read ``[B, H*W, C]``."""

    height: int
    width: int
    channels: int
    patch: int

    @property
    def tokens(self) -> int:
        return (self.height // self.patch) * (self.width // self.patch)

    def latent_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.channels, self.height, self.width)

    def reward_view(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, H*W, C]

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def pixel_layout(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels

    def from_vae_latents(self, z: torch.Tensor) -> torch.Tensor:
        return z


@dataclass(frozen=True)
class VideoLatents(FamilyAdapter):
    """The latent geometry Wan and HunyuanVideo-1.5 share: ``[B, C, F, H, W]`` as the VAE takes it, ``patch`` =
    (frames, height, width) per token; the rewards read ``[B, F, H, W, C]``, pixels are ``[B, F, 3, H, W]``."""

    frames: int
    height: int
    width: int
    channels: int
    patch: tuple[int, int, int]

    @property
    def tokens(self) -> int:
        pt, ph, pw = self.patch
        return (self.frames // pt) * (self.height // ph) * (self.width // pw)

    def latent_shape(self, batch: int) -> tuple[int, int, int, int, int]:
        return (batch, self.channels, self.frames, self.height, self.width)

    def reward_view(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.permute(0, 2, 3, 4, 1)  # [B, C, F, H, W] -> [B, F, H, W, C]

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def pixel_layout(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded.permute(0, 2, 1, 3, 4)  # [B, 3, F, H, W] -> [B, F, 3, H, W]

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.permute(0, 2, 1, 3, 4)  # [B, F, 3, H, W] -> [B, 3, F, H, W]

    def from_vae_latents(self, z: torch.Tensor) -> torch.Tensor:
        return z


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


class PixelDecoder:
    """``decoder(latents [b, ...]) -> pixels`` float32 in [0, 1] (``[b, 3, H, W]`` or ``[b, F, 3, H, W]``), decoding
    ``chunk`` samples at a time on ``device`` in the VAE's dtype (a video VAE's activations are large)."""

    def __init__(self, vae: torch.nn.Module, adapter: Any, device: torch.device | str, chunk: int = 1) -> None:
        self.vae = vae.to(device).eval().requires_grad_(False)
        # a family whose VAE decodes / encodes only so many samples at once caps the chunk (vae_batch)
        self.adapter, self.device = adapter, torch.device(device)
        self.chunk = max(1, min(int(chunk), adapter.vae_batch or int(chunk)))
        self.dtype = next(self.vae.parameters()).dtype

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        out = []
        for part in latents.split(self.chunk):
            # the family's layout and normalisation undone (adapter.to_vae), in the VAE's dtype
            z = self.adapter.to_vae(self.vae, part.to(self.device, self.dtype))
            extra = self.adapter.decode_kwargs(self.vae, z.shape[0], self.device, self.dtype)
            x = self.vae.decode(z, return_dict=False, **extra)[0]
            out.append(self.adapter.pixel_layout((x.float() / 2 + 0.5).clamp(0, 1)))
        return torch.cat(out)


class PixelEncoder:
    """``encoder(pixels [b, 3, H, W] in [0, 1]) -> latents [b, ...]`` in the trainer's layout: the VAE's posterior
    mode (the pipelines' ``retrieve_latents(..., sample_mode="argmax")``), normalised and packed as the family's
    pipeline lays out its latents; ``chunk`` images at a time on ``device`` in the VAE's dtype."""

    def __init__(self, vae: torch.nn.Module, adapter: Any, device: torch.device | str, chunk: int = 1) -> None:
        self.vae = vae.to(device).eval().requires_grad_(False)
        # a family whose VAE decodes / encodes only so many samples at once caps the chunk (vae_batch)
        self.adapter, self.device = adapter, torch.device(device)
        self.chunk = max(1, min(int(chunk), adapter.vae_batch or int(chunk)))
        self.dtype = next(self.vae.parameters()).dtype

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        out = []
        for part in pixels.split(self.chunk):
            x = self.adapter.vae_pixels(part * 2.0 - 1.0).to(self.device, self.dtype)
            z = self.vae.encode(x).latent_dist.mode()
            out.append(self.adapter.from_vae(self.vae, z.float()))
        return torch.cat(out)
