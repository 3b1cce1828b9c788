"""One iteration's data: the rollout and its recomputed old log-probs on weights gathered once
(``rollout.gather_params``), then the rewards and the group-relative advantages (``trainer.py`` runs the loop).

The functions take the trainer (``t``): its engine, adapter, schedule, step rule, config and rewards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..devices import collective_device, fetch_scalars, to_device
from ..ledger import comm_kind, comm_phase
from .algorithms.selection import kept_samples
from .models.experts import route
from .sampling.guidance import WeightHolder
from .sampling.rollout import Trajectory, evaluate_window_step, rollout

__all__ = ["collect", "gather_dp", "recompute_log_probs", "reward_phase", "rollout_phase"]


def collect(t: Any, batch: dict[str, Any]) -> tuple[Trajectory, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rollout, old log-probs ``[B, T]`` (both on weights gathered once: ``rollout.gather_params``), then
    rewards and advantages ``[B]``, for a prepared batch."""
    with t.engine.eval_mode(), t.weight_holder() as hold:
        traj = rollout_phase(t, batch, hold)
        old_log_probs = traj.rollout_log_probs()
        if t.config.flowgrpo.recompute_old_log_probs:
            with comm_phase("old_log_probs"):
                old_log_probs = recompute_log_probs(t, batch, traj, hold)
    with t.engine.eval_mode(), comm_phase("reward"):
        advantages, stats = reward_phase(t, batch, traj)
    return traj, advantages, old_log_probs.detach(), stats


def rollout_phase(t: Any, batch: dict[str, Any], hold: WeightHolder) -> Trajectory:
    """The rollout of a prepared batch (SDE span, ODE elsewhere), each step's engine through ``hold``."""
    g, algorithm = t.config.flowgrpo, t.algorithm
    with comm_phase("rollout"):
        traj = rollout(
            t.engine,
            t.adapter,
            t._cond(batch),
            batch["latents"],
            t.schedule,
            *algorithm.span(batch, t.schedule.num_steps),
            t.rule,
            torch.Generator().manual_seed(batch["sde_seed"]),
            g.cfg_scale,
            final_is_prediction=algorithm.final_is_prediction,
            cfg_batch=t.config.rollout.cfg_batch,
            hold=hold,
            tail=algorithm.tail(batch, t.schedule),
        )
    traj.train_steps, traj.host_steps = batch.get("train_steps"), batch.get("train_steps_host")
    if t.engine.debug_checks:
        t.engine.verify_sp_consistency({"final_latents": traj.final}, "rollout")
    return traj


def recompute_log_probs(t: Any, batch: dict[str, Any], traj: Trajectory, hold: WeightHolder) -> torch.Tensor:
    """``[B, T]``: each trained step's log-prob under the current policy, as training will evaluate it."""
    if traj.steps().shape[1] == 0:
        return traj.rollout_log_probs()  # no trained step (an empty window): [B, 0]
    everyone = torch.arange(traj.latents.shape[0], device=traj.latents.device)
    cond = t._cond(batch)
    return torch.stack(
        [
            evaluate_window_step(
                hold(route(t.engine, traj.host_step(k))),
                t.adapter,
                *traj.step_latents(everyone, k)[1:],
                t.schedule,
                traj.steps()[:, k],
                cond,
                t.rule,
                t.config.flowgrpo.cfg_scale,
                t.config.rollout.cfg_batch,
            ).log_prob
            for k in range(traj.steps().shape[1])
        ],
        dim=1,
    )


def reward_phase(t: Any, batch: dict[str, Any], traj: Trajectory) -> tuple[torch.Tensor, dict[str, float]]:
    """The rollout scored, group-relative advantages ``[B]`` of this rank's samples, and the reward statistics."""
    g = t.config.flowgrpo
    rewards, per_reward = t.score(traj.final, batch)
    # rewards, advantages and their statistics stay on the device (read once, below)
    device = traj.latents.device
    all_groups = gather_dp(t.engine, to_device(batch["group_ids"], device))
    # the total and each reward in one gather: [B, 1 + R]
    table = gather_dp(t.engine, to_device(torch.stack([rewards, *per_reward.values()], dim=1), device))
    all_rewards = table[:, 0].contiguous()
    advantages_all = t.algorithm.advantages(all_rewards, all_groups)
    b = rewards.shape[0]
    advantages = advantages_all[t.engine.dp_rank * b : (t.engine.dp_rank + 1) * b]
    if g.drop_zero_advantage:
        # read by update(); seeded from the batch, so SP peers (which share it) keep the same samples
        batch["kept_indices"] = kept_samples(
            advantages_all,
            t.engine.dp_rank,
            t.engine.dp_size,
            g.mini_batches,
            batch["shuffle_seed"] + 1,
        )
    stats = {
        "reward_mean": all_rewards.mean(),
        "reward_std": all_rewards.std(correction=0),
        "zero_advantage_fraction": (advantages_all == 0).double().mean(),
    }
    if len(per_reward) > 1 or (per_reward and t.config.flowgrpo.rewards):
        stats.update({f"reward/{name}": table[:, 1 + j].mean() for j, name in enumerate(per_reward)})
    return advantages, fetch_scalars(stats)


def gather_dp(engine: Any, t: torch.Tensor) -> torch.Tensor:
    """``t`` of every data-parallel rank stacked along dim 0, rank-major (one all-gather; ``t`` itself at dp 1)."""
    if engine.dp_group is None or engine.dp_size == 1:
        return t
    group = engine.dp_group
    mine = to_device(t, collective_device(group))
    gathered = mine.new_empty((engine.dp_size * mine.shape[0], *mine.shape[1:]))  # rank-major
    with comm_kind("data"):
        dist.all_gather_into_tensor(gathered, mine, group=group)
    return to_device(gathered, t.device)
