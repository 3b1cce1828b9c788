"""GARDO on real gloo ranks: two updates on a fixed trajectory (per-sample windows: a micro-batch's rows at different
sigmas, so the noise-std weights differ), the second against a reference the first moved the policy away from, with a
fixed half of the rows gated; and a fresh rollout's first update (on-policy), scored with the latents as features and
an auxiliary reward gating the KL. Each function returns plain data; the parent (tests/test_gardo_sp.py) asserts."""

from __future__ import annotations

import torch

from tests.workers.dppo_steps import _dppo_old
from tests.workers.engine_steps import _quiet, _trainer
from tests.workers.guard_steps import _fixed_data, _guard_batch, _guard_config, captured_update

GATE = torch.tensor([True, False, False, True, True, False, True, False])  # the rows the KL applies to


def gardo_update(rank: int, world: int, sp: int, ring: int = 1) -> dict:
    _quiet()
    trainer = _trainer(_guard_config(sp, ring, algorithm="gardo", gardo={"features": "none", "kl_coef": 0.5}))
    # the first update moves the policy off its reference (the copy GARDO.attach made), with no KL (nothing gated)
    batch, traj, adv, old = _guard_batch(trainer, _fixed_data(trainer), old_of=_dppo_old)
    first = trainer.update(batch, traj, adv, old)
    batch, traj, adv, old = _guard_batch(trainer, _fixed_data(trainer), old_of=_dppo_old)
    batch.kl_rows = GATE.to(trainer.engine.device)
    metrics, captured, params = captured_update(trainer, batch, traj, adv, old)
    out = {
        "first_kl": first["kl"],
        "loss": metrics["loss"],
        "kl": metrics["kl"],
        "gated": metrics["kl_gated_fraction"],
        "clipfrac": metrics["clipfrac"],
        "step_moved": max((params[n] - captured["before"][n]).abs().max().item() for n in params),
        "grads": captured["grads"] if rank == 0 else None,
        "params": params if rank == 0 else None,
    }
    rewards = [{"fn": "color", "weight": 1.0, "input": "latents"}, {"fn": "mean_latent", "weight": 0.0}]
    gardo = {"features": "latents", "main_reward": "color", "aux_rewards": ["mean_latent"]}
    fresh = _trainer(
        _guard_config(
            sp, ring, algorithm="gardo", sde_steps="all", per_sample_windows=False, prompts_per_rank=2, group_size=4,
            micro_batch_size=8, rewards=rewards, gardo=gardo,
        )
    )
    fresh_batch = fresh.iteration_batch(0).prepared(fresh.engine)
    traj, adv, old, stats = fresh.collect(fresh_batch)
    m = fresh.update(fresh_batch, traj, adv, old)
    out["on_policy"] = {k: m[k] for k in ("ratio_mean", "ratio_std", "ppo_kl", "clipfrac", "kl", "trained_samples")}
    out["on_policy"]["kl_gated_samples"] = stats["kl_gated_samples"]
    out["on_policy"]["advantages"] = adv.cpu()
    out["on_policy"]["gate"] = fresh_batch.kl_rows.cpu()
    return out
