"""Flow-DPPO on real gloo ranks: one update on a fixed trajectory (per-sample windows: a micro-batch's rows at
different sigmas) whose rows are either well inside the trust region or far outside it, and a fresh rollout's first
update (on-policy). Each function returns plain data; the parent (tests/test_flow_dppo_sp.py) asserts."""

from __future__ import annotations

import torch

from tests.workers.engine_steps import _quiet, _trainer
from tests.workers.guard_steps import G, _fixed_data, _guard_batch, _guard_config, captured_update


def _dppo_old(step, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The old log-prob that puts the plain ratio at exactly 1 + target (2e-4 or 8e-3 away: its side of 1 holds
    under any layout's rounding)."""
    return step.log_prob - torch.log1p(target)


def dppo_update(rank: int, world: int, sp: int, ring: int = 1) -> dict:
    _quiet()
    trainer = _trainer(_guard_config(sp, ring, algorithm="flow_dppo"))
    data = _fixed_data(trainer)
    # rows alternately far inside the region (a drift of 1e-6: D ~ 1e-11) and far outside it (0.3: D > 0.1), so no
    # layout's rounding can move a row across the 1e-5 threshold
    size = torch.tensor([1e-6, 0.3]).repeat(G // 2).view(G, 1, *[1] * (data["drift"].ndim - 2))
    data["drift"] = size * torch.sign(data["drift"] + 1e-30)
    batch, traj, adv, old = _guard_batch(trainer, data, old_of=_dppo_old)
    metrics, captured, params = captured_update(trainer, batch, traj, adv, old)
    out = {
        "loss": metrics["loss"],
        "masked": metrics["clipfrac"],
        "outside": metrics["kl_mask_fraction"],
        "step_moved": max((params[n] - captured["before"][n]).abs().max().item() for n in params),
        "grads": captured["grads"] if rank == 0 else None,
        "params": params if rank == 0 else None,
    }
    fresh = _trainer(_guard_config(sp, ring, algorithm="flow_dppo", prompts_per_rank=2, group_size=4, micro_batch_size=8))
    fresh_batch = fresh.iteration_batch(0).prepared(fresh.engine)
    traj, adv, old, _ = fresh.collect(fresh_batch)
    m = fresh.update(fresh_batch, traj, adv, old)
    out["on_policy"] = {k: m[k] for k in ("ratio_mean", "ratio_std", "ppo_kl", "clipfrac", "kl_new_old_max")}
    return out
