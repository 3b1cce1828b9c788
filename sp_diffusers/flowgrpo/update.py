"""The FlowGRPO policy update: mini-batches x micro-batches x window steps, one backward per window step.

For each shuffled mini-batch (one optimizer step) the engine accumulates, over its micro-batches and the W
window steps of each, the gradient of ``flowgrpo_loss / (micro-batches x W)``: the mean over the mini-batch
and the window, as flow_grpo and verl-omni average it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..engine import FSDPEngine
from .config import FlowGRPOConfig
from .loss import flowgrpo_loss
from .rollout import Trajectory, evaluate_window_step

__all__ = ["policy_update", "window_step_loss"]

CondFn = Callable[[torch.Tensor], dict[str, Any]]  # sample indices -> the text conditioning of those samples


def window_step_loss(
    engine: FSDPEngine,
    _batch: Any,
    *,
    adapter: Any,
    sigmas: torch.Tensor,
    g: FlowGRPOConfig,
    traj: Trajectory,
    k: int,
    idx: torch.Tensor,
    cond: dict[str, Any],
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss (+ KL to the adapters-off reference) of window step ``k`` for samples ``idx``
    (the ``loss_fn`` form ``FSDPEngine.forward_backward`` takes; the engine's batch argument is unused)."""

    def evaluate():
        return evaluate_window_step(
            engine,
            adapter,
            traj.latents[idx, k],
            traj.latents[idx, k + 1],
            sigmas,
            traj.window_start + k,
            cond,
            g.noise_level,
            g.cfg_scale,
        )

    step = evaluate()
    kl_args = {}
    if g.kl_coef > 0:
        with torch.no_grad(), engine.adapters_disabled():
            ref = evaluate()  # the reference policy: the base model, adapters off
        kl_args = dict(
            prev_sample_mean=step.prev_sample_mean,
            ref_prev_sample_mean=ref.prev_sample_mean,
            std_dev_t=step.std_dev_t,
        )
    return flowgrpo_loss(
        step.log_prob,
        old_log_probs[idx, k],
        advantages[idx],
        clip_range=g.clip_range,
        normalizer=normalizer,
        kl_coef=g.kl_coef,
        **kl_args,
    )


def policy_update(
    engine: FSDPEngine,
    adapter: Any,
    sigmas: torch.Tensor,
    g: FlowGRPOConfig,
    traj: Trajectory,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    cond_of: CondFn,
    shuffle_seed: int,
) -> dict[str, float]:
    """``g.inner_epochs`` passes over the rollout in ``g.mini_batches`` optimizer steps; metrics averaged over
    every (micro-batch, window step), plus the last step's optimizer metrics (grad norm, lr)."""
    n = traj.latents.shape[0]
    sums: dict[str, float] = {}
    count = 0
    optim_metrics: dict[str, float] = {}
    for epoch in range(g.inner_epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        for mini in perm.chunk(g.mini_batches):
            micros = mini.split(g.micro_batch_size)
            normalizer = float(len(micros) * g.window_size)
            engine.zero_grad()
            for micro in micros:
                idx = micro.to(traj.latents.device)
                cond = cond_of(idx)
                for k in range(g.window_size):
                    loss_fn = functools.partial(
                        window_step_loss,
                        adapter=adapter,
                        sigmas=sigmas,
                        g=g,
                        traj=traj,
                        k=k,
                        idx=idx,
                        cond=cond,
                        advantages=advantages,
                        old_log_probs=old_log_probs,
                        normalizer=normalizer,
                    )
                    for key, value in engine.forward_backward(None, loss_fn).items():
                        if isinstance(value, float):
                            sums[key] = sums.get(key, 0.0) + value
                    count += 1
            optim_metrics = engine.optimizer_step()
    out = {k: v / max(1, count) for k, v in sums.items()}
    out.update(optim_metrics)
    return out
