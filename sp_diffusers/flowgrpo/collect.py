"""One iteration's data: the rollout and its recomputed old log-probs on weights gathered once
(``rollout.gather_params``), then the rewards and the group-relative advantages (``trainer.py`` runs the loop).
Where the algorithm's loss reads the old policy's step means (``Algorithm.keeps_old_means``), they come from
where the old log-probs come from: their recomputation, or the rollout itself (``traj.old_means``).

The functions take the trainer (``t``): its engine, adapter, schedule, step rule, config and rewards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import collective_device, fetch_scalars, to_device
from ..parallel.ledger import comm_kind, comm_phase
from .algorithms.selection import kept_samples
from .models.experts import route
from .sampling.guidance import WeightHolder
from .sampling.rollout import Trajectory, evaluate_window_step, rollout
from .update import micro_batches

__all__ = ["collect", "gather_dp", "recompute_log_probs", "recompute_old_policy", "reward_phase", "rollout_phase"]


def collect(t: Any, batch: dict[str, Any]) -> tuple[Trajectory, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rollout, old log-probs ``[B, T]`` (both on weights gathered once: ``rollout.gather_params``), then
    rewards and advantages ``[B]``, for a prepared batch."""
    means = t.algorithm.keeps_old_means()
    recompute = t.config.flowgrpo.recompute_old_log_probs
    with t.engine.eval_mode(), t.weight_holder() as hold:
        traj = rollout_phase(t, batch, hold, keep_means=means and not recompute)
        old_log_probs = traj.rollout_log_probs()
        if means and not recompute:
            traj.old_means, traj.means = traj.rollout_means(), None  # only the trained steps' are kept
        if recompute and t.algorithm.uses_log_probs:
            with comm_phase("old_log_probs"):
                old_log_probs, old_means = recompute_old_policy(t, batch, traj, hold, means)
            traj.old_means = old_means
    with t.engine.eval_mode(), comm_phase("reward"):
        advantages, stats = reward_phase(t, batch, traj)
    return traj, advantages, old_log_probs.detach(), stats


def rollout_phase(t: Any, batch: dict[str, Any], hold: WeightHolder, keep_means: bool = False) -> Trajectory:
    """The rollout of a prepared batch (SDE span, the algorithm's ODE solver elsewhere) by the algorithm's rollout
    policy, each step's engine through ``hold``; ``keep_means``: the span's step means stored too."""
    g, algorithm = t.config.flowgrpo, t.algorithm
    with comm_phase("rollout"):
        traj = rollout(
            algorithm.rollout_engine(t.engine),
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
            solver=algorithm.ode_solver(),
            keep_means=keep_means,
            tail=algorithm.tail(batch, t.schedule),
        )
    if "train_steps" in batch:  # the algorithm's choice of steps (else the span's own: its window, per sample or not)
        traj.train_steps, traj.host_steps = batch["train_steps"], batch.get("train_steps_host")
    algorithm.store(traj, batch)
    if t.engine.debug_checks:
        t.engine.verify_sp_consistency({"final_latents": traj.final}, "rollout")
    return traj


def recompute_log_probs(t: Any, batch: dict[str, Any], traj: Trajectory, hold: WeightHolder) -> torch.Tensor:
    """``[B, T]``: each trained step's log-prob under the current policy, as training will evaluate it."""
    return recompute_old_policy(t, batch, traj, hold, means=False)[0]


def recompute_old_policy(
    t: Any, batch: dict[str, Any], traj: Trajectory, hold: WeightHolder, means: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([B, T], [B, T, ...] or None)``: each trained step's log-prob under the current policy and (``means``) its
    step mean, evaluated on the micro-batches the update's first pass trains (``update.micro_batches`` of every
    sample), so that the first optimizer step's forwards repeat these bit for bit: the on-policy ratio is exactly 1.
    (Where the zero-advantage filter later drops samples the update's micro-batches differ: then within fp32
    rounding.)"""
    num_trained = traj.steps().shape[1]
    if num_trained == 0:
        return traj.rollout_log_probs(), None  # no trained step (an empty window): [B, 0]
    g = t.config.flowgrpo
    n = traj.latents.shape[0]
    log_probs: torch.Tensor | None = None
    step_means: torch.Tensor | None = None
    for mini in micro_batches(torch.arange(n), g.mini_batches, g.micro_batch_size, batch["shuffle_seed"]):
        for micro in mini:
            idx = to_device(micro, traj.latents.device)
            cond = t._cond(batch, idx)
            for k in range(num_trained):
                steps, latents, next_latents = traj.step_latents(idx, k)  # as the update's step_loss reads them
                step = evaluate_window_step(
                    hold(route(t.engine, traj.host_step(k))),
                    t.adapter,
                    latents,
                    next_latents,
                    t.schedule,
                    steps,
                    cond,
                    t.rule,
                    g.cfg_scale,
                    t.config.rollout.cfg_batch,
                )
                if log_probs is None:
                    log_probs = step.log_prob.new_empty((n, num_trained))
                log_probs[idx, k] = step.log_prob
                if means:  # kept only when asked: T x the latents otherwise
                    if step_means is None:
                        shape = (n, num_trained, *step.prev_sample_mean.shape[1:])
                        step_means = step.prev_sample_mean.new_empty(shape)
                    step_means[idx, k] = step.prev_sample_mean
    assert log_probs is not None
    return log_probs, step_means


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
    if t.algorithm.drops_zero_advantage():
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
