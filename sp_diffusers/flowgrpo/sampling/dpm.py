"""DPM-Solver++ (multistep, order 2) for flow matching, on a compressed schedule after a rollout's span (MixGRPO).

Flow matching's noisy latent is ``x = (1 - sigma) x0 + sigma eps``: in DPM-Solver's notation ``alpha = 1 - sigma``,
``sigma = sigma`` and the half log-SNR ``lambda = log(1 - sigma) - log(sigma)``. The data prediction of a velocity
``v`` is ``x0 = x - sigma v``. One step from ``s0`` to ``t`` (``h = lambda_t - lambda_s0``), with the previous step's
prediction ``m1`` at ``s1`` (``r0 = (lambda_s0 - lambda_s1) / h``, ``D1 = (m0 - m1) / r0``)::

    first order    x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) m0
    midpoint       x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) m0 - 1/2 alpha_t (e^-h - 1) D1
    heun           x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) m0 + alpha_t ((e^-h - 1) / h + 1) D1

(DPM-Solver++, arXiv 2211.01095; diffusers' ``DPMSolverMultistepScheduler`` with ``algorithm_type="dpmsolver++"``
and flow sigmas computes the same.) The step to ``sigma_t = 0`` is first order, as diffusers' ``lower_order_final``
and MixGRPO's sampler take it: it lands on ``m0``.

MixGRPO (``fastvideo/utils/sampling_utils.py``, ``dpm_apply_strategy="post"``) runs the steps after its SDE window
this way, on fewer of them: with ``L`` the window's last step of an ``N``-step shifted-linspace schedule, the tail is
``P = int(max((N - L) r, 1))`` points ``shift(linspace(t_{L+1}, 0, P))`` (``t`` the unshifted grid
``linspace(1, 0, N + 1)``), so it starts at the schedule's ``sigmas[L + 1]`` and ends at 0; the model timestep of a
tail step is ``int(1000 sigma)``, as on the schedule. Its first step is already second order: the history is the
window's last prediction. Coefficients are Python floats computed on the host from the tail's CPU sigmas: a step
costs no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DPM_SOLVER_TYPES", "DPMTail", "compressed_tail", "dpm_solver_pp_step"]

DPM_SOLVER_TYPES = ("midpoint", "heun")


@dataclass(frozen=True)
class DPMTail:
    """The steps after a rollout's span: ``sigmas [P]`` (float32, CPU) from the schedule's sigma after the span down
    to 0, the model timestep ``timesteps [P - 1]`` of each (0..1000 scale), and the second-order form."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    solver_type: str = "midpoint"

    def __post_init__(self) -> None:
        if self.solver_type not in DPM_SOLVER_TYPES:
            raise ValueError(
                f"DPMTail: solver_type={self.solver_type!r}; choose one of {', '.join(DPM_SOLVER_TYPES)}"
            )
        n = self.sigmas.numel()
        if self.sigmas.ndim != 1 or n < 2 or float(self.sigmas[-1]) != 0.0 or self.timesteps.shape != (n - 1,):
            raise ValueError(
                f"DPMTail: sigmas must be 1-D with at least 2 points ending at 0 and timesteps one per step, got "
                f"sigmas {self.sigmas.tolist()} and timesteps of shape {tuple(self.timesteps.shape)}; build it with "
                "compressed_tail()"
            )

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1


def compressed_tail(
    num_steps: int, shift: float, last: int, ratio: float, solver_type: str = "midpoint"
) -> DPMTail:
    """MixGRPO's tail after the span's last step ``last`` of the ``num_steps``-step shifted linspace (module
    docstring), in float32 as the schedule (``pipeline_schedule.linspace_schedule``) is computed, so its first sigma
    is the schedule's ``sigmas[last + 1]`` bit for bit.

    ``P = int(max((num_steps - last) * ratio, 1))`` points as MixGRPO counts them, but at least 2: where MixGRPO's
    count is 1 its tail is the one point ``sigmas[last + 1]`` and its sampler stops there, a latent still at that
    noise level; two points take the one step to 0 (a first-order step: the data prediction)."""
    if not 0 <= last < num_steps - 1:
        raise ValueError(
            f"compressed_tail: last={last} must leave a step after it in {num_steps} steps (0 <= last < "
            f"{num_steps - 1}); a span that reaches the end needs no tail"
        )
    if not 0 < ratio <= 1:
        raise ValueError(f"compressed_tail: ratio={ratio!r} must be in (0, 1] (MixGRPO's: 0.4)")
    points = max(int(max((num_steps - last) * ratio, 1)), 2)
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
    grid = torch.linspace(float(t[last + 1]), 0.0, points, dtype=torch.float32)
    sigmas = shift * grid / (1.0 + (shift - 1.0) * grid)
    timesteps = (sigmas[:-1] * 1000.0).to(torch.int64).to(torch.float32)  # int(1000 sigma), truncated
    return DPMTail(sigmas, timesteps, solver_type)


def _lambda(sigma: float) -> float:
    return math.log(1.0 - sigma) - math.log(sigma)


def dpm_solver_pp_step(
    sample: torch.Tensor,
    x0: torch.Tensor,
    sigma: float,
    sigma_next: float,
    previous: tuple[torch.Tensor, float] | None = None,
    solver_type: str = "midpoint",
) -> torch.Tensor:
    """One DPM-Solver++ step of ``sample`` ``[B, ...]`` at ``sigma`` to ``sigma_next`` (host floats) given its data
    prediction ``x0``: second order with ``previous = (x0 at the previous step, its sigma)``, first order without it,
    from a previous sigma of 1, or to ``sigma_next = 0`` (which returns ``x0``). Computed in ``sample``'s dtype (at
    least float32)."""
    if solver_type not in DPM_SOLVER_TYPES:
        raise ValueError(f"dpm_solver_pp_step: solver_type={solver_type!r}; choose one of {DPM_SOLVER_TYPES}")
    if not 0.0 <= sigma_next < sigma < 1.0:
        raise ValueError(
            f"dpm_solver_pp_step: needs 0 <= sigma_next < sigma < 1, got sigma={sigma!r}, sigma_next={sigma_next!r} "
            "(sigma = 1 has no finite log-SNR: the step from pure noise is the sampler's first, never a tail's)"
        )
    dtype = torch.promote_types(sample.dtype, torch.float32)
    x, m0 = sample.to(dtype), x0.to(dtype)
    if sigma_next == 0.0:
        return m0  # lambda_t = inf: sigma_t / sigma_s = 0 and e^-h = 0, so x_t = m0 exactly
    h = _lambda(sigma_next) - _lambda(sigma)
    phi = math.expm1(-h)  # e^-h - 1
    alpha_next = 1.0 - sigma_next
    out = x * (sigma_next / sigma) + m0 * (-alpha_next * phi)
    if previous is None or previous[1] >= 1.0:
        # at sigma_prev = 1 lambda_s1 = -inf: r0 = inf and D1 = 0 (MixGRPO's float arithmetic), a first-order step
        return out
    m1, sigma_prev = previous
    r0 = (_lambda(sigma) - _lambda(sigma_prev)) / h
    # D1 = (m0 - m1) / r0, weighted by midpoint's -1/2 alpha_t (e^-h - 1) or heun's alpha_t ((e^-h - 1) / h + 1)
    weight = -0.5 * alpha_next * phi if solver_type == "midpoint" else alpha_next * (phi / h + 1.0)
    c1 = weight / r0
    return out + (m0 - m1.to(dtype)) * c1
