"""Flow-matching sigma math: ``linspace(1, 1/N, N)`` with an optional time shift, and Qwen-Image's ``mu``.

``flow_sigmas`` is what ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/N, N))`` gives
(Qwen-Image / Flux pipelines) *without* Qwen-Image's ``shift_terminal``, and DanceGRPO's schedule (its
``linspace(1, 0, N + 1)[:N]`` is the same grid). It is not what SD3's pipeline samples with (``set_timesteps(N)``
starts from the shifted training grid, ending at 0.0089 rather than shift(1/N)), nor Wan's UniPC schedule: the
trainer takes those from the real schedulers (``pipeline_schedule.py``). Computed in float64 and rounded once to
float32 (diffusers rounds the linspace to float32 first and shifts in float32: a few float32 ulps apart).
"""

from __future__ import annotations

import math

import torch

__all__ = ["flow_sigmas", "qwenimage_mu", "timesteps_from_sigmas"]


def flow_sigmas(num_steps: int, *, shift: float | None = None, mu: float | None = None) -> torch.Tensor:
    """The ``num_steps + 1`` sigmas ``[N + 1]`` (float32) of an ``N``-step flow-matching sampler.

    ``linspace(1, 1/N, N)``, then at most one time shift, then a terminal ``0``:

    - ``shift`` (SD3 / Wan style, static): ``shift * s / (1 + (shift - 1) * s)``;
    - ``mu`` (Qwen-Image / Flux style, resolution dependent, see :func:`qwenimage_mu`):
      ``exp(mu) / (exp(mu) + (1/s - 1))``.

    Both shifts keep ``s = 1`` at 1, so ``sigmas[0] == 1`` and the first SDE step needs
    ``sigma_one_substitute=sigmas[1]`` (see :func:`sp_diffusers.flowgrpo.sde_step_with_logprob`).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(
            f"flow_sigmas: num_steps must be an int >= 2, got {num_steps!r}; pass the number of denoising "
            "steps (FlowGRPO rollouts typically use about 10; the SDE step at sigma == 1 needs sigmas[1] < 1)."
        )
    if shift is not None and mu is not None:
        raise ValueError(
            f"flow_sigmas: got both shift={shift!r} and mu={mu!r}; they are alternative time shifts "
            "(shift: static SD3/Wan style, mu: resolution-dependent Qwen-Image/Flux style), pass only one."
        )
    sigmas = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    if shift is not None:
        if not shift > 0:
            raise ValueError(
                f"flow_sigmas: shift must be > 0, got {shift!r}; use the model scheduler's `shift` "
                "(1.0 means no shift)."
            )
        sigmas = shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    elif mu is not None:
        if not math.isfinite(mu):
            raise ValueError(f"flow_sigmas: mu must be finite, got {mu!r}; compute it with qwenimage_mu().")
        sigmas = math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
    sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
    return sigmas.to(torch.float32)


def qwenimage_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The resolution-dependent shift ``mu`` of diffusers' Qwen-Image / Flux pipelines (``calculate_shift``).

    Linear in the number of image tokens: ``base_shift`` at ``base_seq_len``, ``max_shift`` at
    ``max_seq_len`` (extrapolated outside). The defaults are the pipelines' fallbacks; the pipelines
    read the real values from the scheduler config (``base_image_seq_len``, ``max_image_seq_len``,
    ``base_shift``, ``max_shift``), which differ per model (Qwen-Image: 256, 8192, 0.5, 0.9), so pass those.
    """
    if max_seq_len == base_seq_len:
        raise ValueError(
            f"qwenimage_mu: max_seq_len ({max_seq_len}) must differ from base_seq_len ({base_seq_len}); "
            "pass the scheduler config's max_image_seq_len and base_image_seq_len."
        )
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return float(image_seq_len * m + b)


def timesteps_from_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """The model timesteps ``[N]`` for sigmas ``[N + 1]``: ``sigmas[:-1] * 1000`` (the terminal 0 has none)."""
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(
            f"timesteps_from_sigmas: sigmas must be 1-D with the terminal 0 appended (length N + 1 >= 2), "
            f"got shape {tuple(sigmas.shape)}; pass the output of flow_sigmas()."
        )
    return sigmas[:-1] * 1000.0
