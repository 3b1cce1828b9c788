"""How a family's pipeline scales its latents for the VAE, from the VAE's own config: ``latents_mean`` /
``latents_std`` (Qwen-Image's and Wan's VAEs: ``z * std + mean`` before ``decode``) or ``scaling_factor`` /
``shift_factor`` (SD3's, FLUX.1's, Z-Image's: ``z / scaling + shift``). ``FamilyAdapter.to_vae`` / ``from_vae`` use it
by default (FLUX.2's adapter undoes its VAE's batch-norm statistics instead)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["denormalize", "normalize"]


def _latent_stats(vae: Any, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The VAE config's per-channel ``(latents_mean, latents_std)`` shaped to broadcast over ``z`` (Qwen-Image's and
    Wan's VAEs), or None where it scales by ``scaling_factor`` / ``shift_factor`` (SD3's and Flux's)."""
    cfg = vae.config
    mean = getattr(cfg, "latents_mean", None)
    if mean is None:
        return None
    shape = (1, len(mean)) + (1,) * (z.ndim - 2)
    m = torch.tensor(mean, dtype=z.dtype, device=z.device).view(shape)
    return m, torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(shape)


def denormalize(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The pipeline's latents -> the VAE's latent scale (what ``vae.decode`` takes)."""
    stats = _latent_stats(vae, z)
    if stats is not None:
        m, s = stats
        return z * s + m
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return z / vae.config.scaling_factor + shift


def normalize(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The VAE's latent scale -> the pipeline's latents (the inverse of :func:`denormalize`, as the pipelines
    normalise an encoded image)."""
    stats = _latent_stats(vae, z)
    if stats is not None:
        m, s = stats
        return (z - m) / s
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (z - shift) * vae.config.scaling_factor
