"""DiffusionNFT's deterministic rollout solver ``dpm2``: DPM-Solver++ 2M on the predicted data, as
NVlabs/DiffusionNFT's ``flow_grpo/diffusers_patch/solver.py`` runs it (``run_sampling(..., solver="dpm2",
determistic=True)``; its header says "modified from MixGRPO"): every step of a rollout in order, the first and the
last first order (DDIM with eta 0), the others second order with the previous step's data prediction as history.
The step itself is ``dpm.dpm_solver_pp_step`` (midpoint), the one DPM-Solver++ of the package; only the first step
from pure noise (``sigma = 1``, where the log-SNR is ``-inf``) is written here, as DDIM: ``x' = (1 - t) m + t x``.
At ``sigma_{i-1} = 1`` the second step's history has ``r0 = inf``, so it is first order too (``dpm_solver_pp_step``
says so outright; the reference's fp64 arithmetic gives it through infinities).
"""

from __future__ import annotations

import torch

from .dpm import dpm_solver_pp_step

__all__ = ["DPMSolver2"]


class DPMSolver2:
    """One rollout's ``dpm2`` steps: ``step(x, v, sigmas, i)`` for i = 0, 1, ... in order (it keeps the previous
    step's predicted data). Steps it does not see (an SDE span elsewhere) break the multistep history: use a fresh
    solver per rollout, for rollouts whose every step is deterministic."""

    def __init__(self) -> None:
        self.previous: tuple[torch.Tensor, float] | None = None
        self.last_step = -1

    def step(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        if i != self.last_step + 1:
            raise ValueError(
                f"DPMSolver2.step: step {i} after step {self.last_step}; the multistep solver runs every step in "
                "order from 0 (flowgrpo.nft.solver=euler for rollouts with stochastic steps)"
            )
        dtype = torch.promote_types(torch.promote_types(x.dtype, v.dtype), torch.float32)
        x, v = x.to(dtype), v.to(dtype)
        s, t = float(sigmas[i]), float(sigmas[i + 1])  # the schedule's CPU copy: no device sync
        m = x - s * v  # the predicted data
        if s >= 1.0:
            out = (1.0 - t) * m + t * x  # from pure noise: DDIM (no finite log-SNR at sigma = 1)
        else:
            last = i == len(sigmas) - 2
            out = dpm_solver_pp_step(x, m, s, t, None if i == 0 or last else self.previous)
        self.previous, self.last_step = (m, s), i
        return out
