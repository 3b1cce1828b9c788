"""DiffusionNFT's deterministic rollout solver ``dpm2``: DPM-Solver++ 2M on the predicted data, as
NVlabs/DiffusionNFT's ``flow_grpo/diffusers_patch/solver.py`` runs it (``run_sampling(..., solver="dpm2",
determistic=True)``; its header says "modified from MixGRPO").

A flow-matching latent at noise level ``sigma`` is ``x = alpha x0 + sigma eps`` with ``alpha = 1 - sigma``; with
``lambda = log(alpha / sigma)`` and ``m_i = x_i - sigma_i v_i`` the predicted data of step i (``s = sigma_i``,
``t = sigma_{i+1}``, ``h = lambda_t - lambda_s``):

    first and last step (DDIM, eta 0):   x' = (1 - t) m_i + t (x - (1 - s) m_i) / s
    the others (second order):           r0 = (lambda_s - lambda_{i-1}) / h,   D1 = (m_i - m_{i-1}) / r0
                                         x' = (t / s) x - alpha_t (e^-h - 1) m_i - 1/2 alpha_t (e^-h - 1) D1

The first-order updates equal an Euler step in exact arithmetic; the second-order term is the multistep
correction. At ``sigma_{i-1} = 1`` (step 1 of a schedule that starts at pure noise) ``lambda_{i-1} = -inf``, so
``1 / r0 = 0`` and ``D1 = 0``: the reference's fp64 arithmetic gives that through infinities, this module says it
outright. The coefficients are computed in fp64 on the host (the reference casts its sigmas to fp64), the
latents stay in their own dtype (at least fp32).
"""

from __future__ import annotations

import math

import torch

__all__ = ["DPMSolver2", "dpm2_coefficients"]


def _lam(sigma: float) -> float:
    """``log(alpha / sigma)``, ``-inf`` at sigma = 1 (alpha = 0), as fp64 ``log(0)`` is."""
    return -math.inf if sigma >= 1.0 else math.log(1.0 - sigma) - math.log(sigma)


def dpm2_coefficients(sigmas: list[float], i: int) -> tuple[float, float, float]:
    """``(c_x, c_m, c_d)`` of step ``i`` (0-based, of ``len(sigmas) - 1`` steps): the second-order update is
    ``x' = c_x x + c_m m_i + c_d (m_i - m_{i-1})``; the first and last steps are DDIM (:class:`DPMSolver2`)."""
    s1, s0, t = sigmas[i - 1], sigmas[i], sigmas[i + 1]
    alpha_t = 1.0 - t
    h = _lam(t) - _lam(s0)
    phi = alpha_t * (math.exp(-h) - 1.0)
    h0 = _lam(s0) - _lam(s1)
    inv_r0 = 0.0 if math.isinf(h0) else h / h0  # 1 / r0; r0 = inf where sigma_{i-1} = 1
    return t / s0, -phi, -0.5 * phi * inv_r0


class DPMSolver2:
    """One rollout's ``dpm2`` steps: ``step(x, v, sigmas, i)`` for i = 0, 1, ... in order (it keeps the previous
    step's predicted data). Steps it does not see (an SDE span elsewhere) break the multistep history: use a fresh
    solver per rollout, for rollouts whose every step is deterministic."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.last_step = -1

    def step(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        if i != self.last_step + 1:
            raise ValueError(
                f"DPMSolver2.step: step {i} after step {self.last_step}; the multistep solver runs every step in "
                "order from 0 (flowgrpo.nft_solver=euler for rollouts with stochastic steps)"
            )
        dtype = torch.promote_types(torch.promote_types(x.dtype, v.dtype), torch.float32)
        x, v = x.to(dtype), v.to(dtype)
        host = [float(s) for s in sigmas]
        s, t = host[i], host[i + 1]
        m = x - s * v  # the predicted data
        if i == 0 or i == len(host) - 2:
            out = (1.0 - t) * m + t * ((x - (1.0 - s) * m) / s)
        else:
            c_x, c_m, c_d = dpm2_coefficients(host, i)
            out = c_x * x + c_m * m + c_d * (m - self.previous)
        self.previous, self.last_step = m, i
        return out
