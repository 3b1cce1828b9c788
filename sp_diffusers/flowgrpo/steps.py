"""The other stochastic steps of the reference trainers, and the rule that picks one for a run.

With ``x`` the latent at ``sigma``, ``sigma' < sigma`` the next level, ``dt = sigma' - sigma``, ``v`` the velocity,
``x0 = x - sigma v`` (predicted data) and ``x1 = x + (1 - sigma) v`` (predicted noise):

**CPS** (flow_grpo ``sde_type='cps'``, coefficients-preserving sampling), ``a`` = noise level::

    s      = sigma' sin(a pi / 2)
    mean   = (1 - sigma') x0 + sqrt(sigma'^2 - s^2) x1
    x'     = mean + s eps
    "log p" = mean over non-batch elements of -(x' - mean)^2

The reference drops every constant of the Gaussian log-density *and its 1 / (2 s^2) factor*, so the PPO ratio
``exp(lp - lp_old)`` is the true ratio raised to the power ``2 s^2`` (a step-dependent temperature): kept as is,
since that is what flow_grpo trains. At ``sigma' = 0`` the step is deterministic (``x' = x0``).

**DanceGRPO** (arXiv 2505.07818, its repository's ``flux_step`` and verl-omni's ``dance_sde``), ``eta``::

    score  = -(x + (1 - sigma) v) / sigma                 (= -(x - (1 - sigma) x0) / sigma^2)
    mean   = x + dt v - eta^2 / 2 * score * dt
    std    = eta sqrt(sigma - sigma')
    x'     = mean + std eps
    log p  = mean over non-batch elements of the Gaussian log-density (constants included)

which is flow_grpo's SDE mean with its ``std_t`` replaced by the constant ``eta``, and needs no special case at
sigma = 1. :class:`StepRule` chooses among these and flow_grpo's default SDE (``sde.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..devices import to_device
from .sde import (
    _LOG_SQRT_2PI,
    SDEStep,
    Sigma,
    _check_pair,
    _check_sigmas,
    _compute_dtype,
    _per_sample,
    sde_step_with_logprob,
)

__all__ = ["SDE_TYPES", "StepRule", "cps_step_with_logprob", "dance_step_with_logprob"]

SDE_TYPES = ("sde", "cps", "dance")


def _noise(sample: torch.Tensor, generator: torch.Generator | None, dtype: torch.dtype) -> torch.Tensor:
    # drawn in the compute dtype (float32 for bf16 latents, as flow_grpo draws it) on the generator's device, as
    # sde_step_with_logprob draws it
    device = generator.device if generator is not None else sample.device
    eps = torch.randn(sample.shape, generator=generator, dtype=dtype, device=device)
    return to_device(eps, sample.device)  # queued: a CPU generator's noise costs no host sync


def _prepare(sample, model_output, sigma, sigma_next, prev_sample, fn):
    _check_pair(sample, model_output, fn)
    _check_sigmas(sigma, sigma_next, fn)
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"{fn}: prev_sample shape {tuple(prev_sample.shape)} != sample shape {tuple(sample.shape)}; pass the "
            "stored next latent of this step"
        )
    dtype = _compute_dtype(sample, model_output)
    sig = _per_sample(sigma, "sigma", sample, dtype)
    sig_next = _per_sample(sigma_next, "sigma_next", sample, dtype)
    return dtype, sample.to(dtype), model_output.to(dtype), sig, sig_next


def cps_step_with_logprob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStep:
    """flow_grpo's CPS step (module docstring). ``std_dev_t`` is ``s = sigma' sin(a pi / 2)``, as flow_grpo
    returns it (its KL term divides by ``2 s^2``)."""
    fn = "cps_step_with_logprob"
    if not 0 < noise_level < 1:
        raise ValueError(
            f"{fn}: noise_level must be in (0, 1) (the angle a pi / 2 of sin/cos), got {noise_level!r}; flow_grpo's "
            "CPS configs use 0.8"
        )
    dtype, x, v, sig, sig_next = _prepare(sample, model_output, sigma, sigma_next, prev_sample, fn)
    s = sig_next * math.sin(noise_level * math.pi / 2.0)
    x0 = x - sig * v
    x1 = x + (1.0 - sig) * v
    # sqrt(sigma'^2 - s^2) rather than sigma' cos(a pi / 2): the same number, rounded as flow_grpo rounds it
    mean = x0 * (1.0 - sig_next) + x1 * torch.sqrt(sig_next**2 - s**2)
    x_prev = mean + s * _noise(sample, generator, dtype) if prev_sample is None else prev_sample.to(dtype)
    log_p = -((x_prev.detach() - mean) ** 2)
    return SDEStep(
        prev_sample=x_prev,
        log_prob=log_p.mean(dim=tuple(range(1, log_p.ndim))),
        prev_sample_mean=mean,
        std_dev_t=s.reshape(sample.shape[0]),
    )


def dance_step_with_logprob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    eta: float,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStep:
    """DanceGRPO's step (module docstring). ``std_dev_t`` is ``eta`` (the noise std without ``sqrt(-dt)``, as
    :func:`sde_step_with_logprob` reports its ``std_t``)."""
    fn = "dance_step_with_logprob"
    if not eta > 0:
        raise ValueError(
            f"{fn}: eta (flowgrpo.noise_level) must be > 0, got {eta!r}; DanceGRPO's scripts use 0.3 (0.25 for "
            "HunyuanVideo), verl-omni's Wan 2.2 example 1.2"
        )
    dtype, x, v, sig, sig_next = _prepare(sample, model_output, sigma, sigma_next, prev_sample, fn)
    dt = sig_next - sig
    score = -(x + (1.0 - sig) * v) / sig
    mean = x + dt * v + (-0.5 * eta**2 * score) * dt
    std = eta * torch.sqrt(-dt)
    x_prev = mean + std * _noise(sample, generator, dtype) if prev_sample is None else prev_sample.to(dtype)
    log_p = -((x_prev.detach() - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return SDEStep(
        prev_sample=x_prev,
        log_prob=log_p.mean(dim=tuple(range(1, log_p.ndim))),
        prev_sample_mean=mean,
        std_dev_t=torch.full((sample.shape[0],), float(eta), dtype=dtype, device=sample.device),
    )


@dataclass(frozen=True)
class StepRule:
    """Which stochastic step a run's SDE steps take: ``sde`` (flow_grpo's default), ``cps`` or ``dance``."""

    sde_type: str
    noise_level: float

    def __post_init__(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {self.sde_type!r}")

    def step(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        sigmas: torch.Tensor,
        step_index: int | torch.Tensor,
        *,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> SDEStep:
        """Step ``step_index`` of the schedule ``sigmas``.

        ``step_index``: an int (then ``sigmas`` is read on the host: pass the schedule's CPU copy, as
        ``Schedule.sigmas`` is), or a ``[B]`` long tensor, one step per sample (then everything happens on the
        index's device: the sigmas are gathered there, never the index brought to the host).
        """
        if isinstance(step_index, torch.Tensor):
            on_device = to_device(sigmas, step_index.device)
            sigma, sigma_next = on_device[step_index], on_device[step_index + 1]
            sigma_one = on_device[1]
        else:
            sigma, sigma_next = float(sigmas[step_index]), float(sigmas[step_index + 1])
            sigma_one = float(sigmas[1])
        kwargs = dict(prev_sample=prev_sample, generator=generator)
        if self.sde_type == "sde":
            return sde_step_with_logprob(
                sample,
                model_output,
                sigma,
                sigma_next,
                self.noise_level,
                sigma_one_substitute=sigma_one,
                **kwargs,
            )
        if self.sde_type == "cps":
            return cps_step_with_logprob(sample, model_output, sigma, sigma_next, self.noise_level, **kwargs)
        return dance_step_with_logprob(sample, model_output, sigma, sigma_next, self.noise_level, **kwargs)
