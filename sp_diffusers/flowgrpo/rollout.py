"""Rollout with an SDE window, and the per-window-step log-prob evaluation the trainer shares with it.

Steps outside the window are deterministic ODE steps; the W window steps are SDE steps whose log-probs
make the policy. Stored per sample: ``latents [B, W+1, L, C]`` (the window's inputs and outputs),
``log_probs [B, W]``, ``sigma_index [B]`` (the window's first step), ``final [B, L, C]``.

Every rank of an SP group calls this with the same batch and the same generator seed, so the noise,
the window and the latents are identical there; the transformer's Ulysses attention does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .sde import SDEStep, ode_step, sde_step_with_logprob

__all__ = ["Trajectory", "evaluate_window_step", "rollout", "velocity"]


@dataclass
class Trajectory:
    latents: torch.Tensor  # [B, W+1, L, C] float32
    log_probs: torch.Tensor  # [B, W]
    window_start: int  # index into sigmas of the first SDE step
    final: torch.Tensor  # [B, L, C] the denoised latents (reward input)


def velocity(
    engine, adapter, latents: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any], cfg_scale: float
) -> torch.Tensor:
    """The model's velocity at ``(latents, sigma)``; with ``cfg_scale > 1`` classifier-free guidance."""
    dtype = next(engine.model.parameters()).dtype
    x = latents.to(dtype)
    v = engine.forward(
        **adapter.inputs(
            x,
            sigma,
            cond["prompt_embeds"].to(dtype),
            cond["prompt_embeds_mask"],
            cond.get("pooled_prompt_embeds"),
        )
    )
    if cfg_scale > 1.0:
        v_neg = engine.forward(
            **adapter.inputs(
                x,
                sigma,
                cond["negative_prompt_embeds"].to(dtype),
                cond["negative_prompt_embeds_mask"],
                cond.get("negative_pooled_prompt_embeds"),
            )
        )
        v = v_neg + cfg_scale * (v - v_neg)
    return v.float()


def evaluate_window_step(
    engine,
    adapter,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int,
    cond: dict[str, Any],
    noise_level: float,
    cfg_scale: float,
) -> SDEStep:
    """Log-prob of the stored ``next_latents`` under the current policy at SDE step ``step_index``."""
    sigma, sigma_next = sigmas[step_index], sigmas[step_index + 1]
    v = velocity(engine, adapter, latents, sigma, cond, cfg_scale)
    return sde_step_with_logprob(
        latents,
        v,
        float(sigma),
        float(sigma_next),
        noise_level,
        sigma_one_substitute=float(sigmas[1]),
        prev_sample=next_latents,
    )


@torch.no_grad()
def rollout(
    engine,
    adapter,
    cond: dict[str, Any],
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    window_start: int,
    window_size: int,
    noise_level: float,
    generator: torch.Generator,
    cfg_scale: float = 1.0,
) -> Trajectory:
    """Denoise ``noise`` ``[B, L, C]`` from sigma = 1 to 0; SDE steps in ``[window_start, window_start + W)``."""
    num_steps = sigmas.numel() - 1
    if not 0 <= window_start <= num_steps - window_size:
        raise ValueError(
            f"window_start={window_start} with window_size={window_size} does not fit {num_steps} steps; "
            f"fix: flowgrpo.window_range within [0, {num_steps - window_size + 1})"
        )
    x = noise.float()
    stored, log_probs = [], []
    for i in range(num_steps):
        v = velocity(engine, adapter, x, sigmas[i], cond, cfg_scale)
        if window_start <= i < window_start + window_size:
            stored.append(x)
            step = sde_step_with_logprob(
                x,
                v,
                float(sigmas[i]),
                float(sigmas[i + 1]),
                noise_level,
                sigma_one_substitute=float(sigmas[1]),
                generator=generator,
            )
            x = step.prev_sample
            log_probs.append(step.log_prob)
        else:
            x = ode_step(x, v, float(sigmas[i]), float(sigmas[i + 1]))
        if i == window_start + window_size - 1:
            stored.append(x)
    return Trajectory(torch.stack(stored, dim=1), torch.stack(log_probs, dim=1), window_start, x)
