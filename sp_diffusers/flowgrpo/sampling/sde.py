"""The denoising steps as Gaussian policies (Flow-GRPO's SDE, CPS, DanceGRPO), their ODE counterpart, and the
rule that picks one for a run.

With ``sigma`` the current and ``sigma_next`` the next noise level, ``dt = sigma_next - sigma < 0`` and
``v`` the velocity predicted by the model, the SDE step is (Flow-GRPO, arXiv 2505.05470)::

    std_t  = sqrt(sigma / (1 - min(sigma, s1))) * noise_level     (s1 = sigma_one_substitute = sigmas[1])
    mean   = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
    x_prev = mean + std_t * sqrt(-dt) * eps,   eps ~ N(0, I)

and its log-probability is the Gaussian log-density of ``x_prev`` averaged (not summed) over every
non-batch element. ``min(sigma, sigmas[1])`` changes only the schedule's first step, where ``1 - sigma`` is 0
(FlowMatch: sigma = 1, where flow_grpo substitutes sigmas[1]) or nearly 0 (Wan's UniPC: 1 - 1e-6, where the
plain formula would give a noise std of ~1000 a). Everything is computed in at least float32 so that the rollout's log-probs and the
trainer's recomputation agree regardless of the model's bf16/fp16 dtype.

The other stochastic steps of the reference trainers:

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
sigma = 1.

:class:`StepRule` picks one of the three for a run; every step's rules live here, in one module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...parallel.devices import to_device

__all__ = [
    "SDE_TYPES",
    "SDEStep",
    "StepRule",
    "cps_step_with_logprob",
    "dance_step_with_logprob",
    "ode_step",
    "sde_step_with_logprob",
]

SDE_TYPES = ("sde", "cps", "dance")

_LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))

Sigma = float | torch.Tensor


@dataclass(frozen=True)
class SDEStep:
    """The result of :func:`sde_step_with_logprob`, for a sample of shape ``[B, ...]``.

    Attributes:
        prev_sample: ``[B, ...]`` the next latent ``x_prev`` (sampled, or the one passed in).
        log_prob: ``[B]`` float32 (float64 for float64 inputs) per-element mean Gaussian log-density.
        prev_sample_mean: ``[B, ...]`` the Gaussian mean (carries the gradient of ``model_output``).
        std_dev_t: ``[B]`` ``std_t`` (without the ``sqrt(-dt)`` factor), as the KL term uses it.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # bf16/fp16 are too coarse for a log-density that is later exponentiated into a PPO ratio.
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _per_sample(value: Sigma, name: str, sample: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A python float, 0-d tensor or ``[B]`` tensor as a ``[B, 1, ..., 1]`` tensor that broadcasts over ``sample``."""
    batch = sample.shape[0]
    if not isinstance(value, torch.Tensor):
        # filled on the device: a Python number through torch.as_tensor would be a blocking host-to-device copy
        return torch.full((batch, *([1] * (sample.ndim - 1))), value, dtype=dtype, device=sample.device)
    t = to_device(value, sample.device).to(dtype)
    if t.ndim == 0:
        t = t.expand(batch)
    elif t.shape != (batch,):
        raise ValueError(
            f"{name} must be a python float, a 0-d tensor or a tensor of shape [B] = [{batch}], "
            f"got shape {tuple(t.shape)}; pass one value per sample (e.g. sigmas[step_index])."
        )
    return t.reshape(batch, *([1] * (sample.ndim - 1)))


def _check_sigmas(sigma: Sigma, sigma_next: Sigma, fn: str) -> None:
    # Only python floats are range-checked: checking tensor values would force a host sync every step.
    if not isinstance(sigma, torch.Tensor) and not 0.0 < sigma <= 1.0:
        raise ValueError(f"{fn}: sigma must be in (0, 1], got {sigma!r}; pass sigmas[i] of flow_sigmas().")
    if not isinstance(sigma_next, torch.Tensor) and not 0.0 <= sigma_next < 1.0:
        raise ValueError(
            f"{fn}: sigma_next must be in [0, 1), got {sigma_next!r}; pass sigmas[i + 1] of flow_sigmas()."
        )
    if (
        not isinstance(sigma, torch.Tensor)
        and not isinstance(sigma_next, torch.Tensor)
        and sigma_next >= sigma
    ):
        raise ValueError(
            f"{fn}: sigma_next ({sigma_next!r}) must be < sigma ({sigma!r}); denoising runs from sigma 1 to 0, "
            "pass (sigmas[i], sigmas[i + 1])."
        )


def _check_pair(sample: torch.Tensor, model_output: torch.Tensor, fn: str) -> None:
    if sample.ndim < 2:
        raise ValueError(
            f"{fn}: sample must have a batch dim and at least one more, got shape {tuple(sample.shape)}; "
            "pass latents of shape [B, L, C] (packed) or [B, C, ...]."
        )
    if model_output.shape != sample.shape:
        raise ValueError(
            f"{fn}: model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}; "
            "pass the velocity predicted for this sample (unpatchified / unpacked the same way)."
        )


def _noise(
    sample: torch.Tensor, generator: torch.Generator | None, dtype: torch.dtype, noise: torch.Tensor | None = None
) -> torch.Tensor:
    # drawn in the compute dtype (float32 for bf16 latents, as flow_grpo draws it) on the generator's device, as
    # sde_step_with_logprob draws it; or the step's noise drawn by the caller (a rollout in chunks: BatchNoise)
    if noise is not None:
        if noise.shape != sample.shape:
            raise ValueError(f"the step's noise has shape {tuple(noise.shape)}, the sample {tuple(sample.shape)}")
        return noise.to(sample.device, dtype)
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


def sde_step_with_logprob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float,
    *,
    sigma_one_substitute: Sigma,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStep:
    """One Flow-GRPO SDE step from ``sample`` ``[B, ...]`` and the velocity ``model_output`` ``[B, ...]``.

    Args:
        sample: ``[B, ...]`` the current latent ``x`` at noise level ``sigma``.
        model_output: ``[B, ...]`` the velocity ``v`` the model predicts for ``sample``.
        sigma: current noise level, a python float or a ``[B]`` tensor, in ``(0, 1]``.
        sigma_next: next noise level (``< sigma``), a python float or a ``[B]`` tensor, in ``[0, 1)``.
        noise_level: the SDE noise scale ``a > 0`` (0 would be the ODE step: use :func:`ode_step`).
        sigma_one_substitute: ``std_t``'s denominator is ``1 - min(sigma, sigma_one_substitute)``: pass
            ``sigmas[1]``, so only the first step (sigma = 1, or UniPC's 1 - 1e-6) uses it, as flow_grpo does
            at sigma = 1 (where ``1 - sigma`` would divide by zero).
        prev_sample: ``[B, ...]`` a stored ``x_prev`` to evaluate (training); ``None`` samples one (rollout).
        generator: random generator for the noise when sampling; the noise is drawn in the compute dtype (float32,
            or float64 for float64 inputs) on the generator's device, then moved to ``sample``'s device: flow_grpo
            casts the model output to float32 first and draws in its dtype, so a bf16 rollout draws float32 noise
            there too (a bf16 draw would be another noise, rounded to 8 bits of mantissa).
        noise: the standard normal draw itself, ``sample``'s shape (instead of drawing from ``generator``).

    Returns:
        :class:`SDEStep`. ``prev_sample`` and ``prev_sample_mean`` are in the compute dtype (at least
        float32). ``log_prob`` is evaluated at ``prev_sample.detach()``, so its gradient flows only through
        ``prev_sample_mean`` (i.e. through ``model_output``), as in the reference.
    """
    fn = "sde_step_with_logprob"
    if not noise_level > 0:
        raise ValueError(
            f"{fn}: noise_level must be > 0, got {noise_level!r}; at noise_level 0 the step is deterministic "
            "and has no density, use ode_step() for steps outside the SDE window."
        )
    if not isinstance(sigma_one_substitute, torch.Tensor) and not 0.0 < sigma_one_substitute < 1.0:
        raise ValueError(
            f"{fn}: sigma_one_substitute must be in (0, 1), got {sigma_one_substitute!r}; pass sigmas[1] "
            "of the schedule (flow_sigmas(N)[1])."
        )
    dtype, x, v, sig, sig_next = _prepare(sample, model_output, sigma, sigma_next, prev_sample, fn)
    sub = _per_sample(sigma_one_substitute, "sigma_one_substitute", sample, dtype)

    dt = sig_next - sig
    std_t = torch.sqrt(sig / (1.0 - torch.minimum(sig, sub))) * noise_level
    mean = x * (1.0 + std_t**2 / (2.0 * sig) * dt) + v * (1.0 + std_t**2 * (1.0 - sig) / (2.0 * sig)) * dt
    scale = std_t * torch.sqrt(-dt)

    x_prev = mean + scale * _noise(sample, generator, dtype, noise) if prev_sample is None else prev_sample.to(dtype)

    # The density is of the action x_prev; only the mean (i.e. the policy) may carry gradient.
    log_p = -((x_prev.detach() - mean) ** 2) / (2.0 * scale**2) - torch.log(scale) - _LOG_SQRT_2PI
    log_prob = log_p.mean(dim=tuple(range(1, log_p.ndim)))
    return SDEStep(
        prev_sample=x_prev,
        log_prob=log_prob,
        prev_sample_mean=mean,
        std_dev_t=std_t.reshape(sample.shape[0]),
    )


def ode_step(
    sample: torch.Tensor, model_output: torch.Tensor, sigma: Sigma, sigma_next: Sigma
) -> torch.Tensor:
    """The deterministic Euler step ``x + v * (sigma_next - sigma)``, ``[B, ...]`` in at least float32.

    ``sigma`` / ``sigma_next`` are python floats or ``[B]`` tensors. This is the ``noise_level -> 0``
    limit of :func:`sde_step_with_logprob`'s mean, used outside the SDE window. Cast the result back to the
    model dtype if the next model call needs it (diffusers' scheduler also steps in float32).
    """
    fn = "ode_step"
    _check_pair(sample, model_output, fn)
    _check_sigmas(sigma, sigma_next, fn)
    dtype = _compute_dtype(sample, model_output)
    dt = _per_sample(sigma_next, "sigma_next", sample, dtype) - _per_sample(sigma, "sigma", sample, dtype)
    return sample.to(dtype) + model_output.to(dtype) * dt


def cps_step_with_logprob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
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
    x_prev = mean + s * _noise(sample, generator, dtype, noise) if prev_sample is None else prev_sample.to(dtype)
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
    noise: torch.Tensor | None = None,
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
    x_prev = mean + std * _noise(sample, generator, dtype, noise) if prev_sample is None else prev_sample.to(dtype)
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
        noise: torch.Tensor | None = None,
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
        kwargs = dict(prev_sample=prev_sample, generator=generator, noise=noise)
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
