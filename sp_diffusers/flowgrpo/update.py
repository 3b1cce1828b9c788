"""The FlowGRPO policy update: mini-batches x micro-batches x trained steps, one backward per trained step.

For each shuffled mini-batch (one optimizer step) the engine accumulates, over its micro-batches and the T
trained steps of each (FlowGRPO: the W window steps; DanceGRPO: each sample's own random subset), the gradient
of ``flowgrpo_loss / (micro-batches x T)``: the mean over the mini-batch and the trained steps, as flow_grpo,
DanceGRPO (``/ (gradient_accumulation_steps * train_timesteps)``) and verl-omni average it.

``indices`` restricts the update to some samples (``selection.kept_samples``: the zero-advantage filter); every
data-parallel rank must pass the same number, so they all run the same micro-batches and optimizer steps (FSDP's
collectives pair up across ranks). None of them: no optimizer step at all, on every rank alike.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..devices import fetch_scalars, to_device
from ..engine import FSDPEngine
from ..ledger import comm_phase
from .algorithms.loss import flowgrpo_loss
from .config import FlowGRPOConfig
from .models.experts import route
from .sampling.pipeline_schedule import Schedule
from .sampling.rollout import Trajectory, evaluate_window_step
from .sampling.sde import StepRule

__all__ = ["kl_std", "policy_update", "window_step_loss"]

CondFn = Callable[[torch.Tensor], dict[str, Any]]  # sample indices -> the text conditioning of those samples


def kl_std(
    rule: StepRule, g: FlowGRPOConfig, std_dev_t: torch.Tensor, schedule: Schedule, steps: torch.Tensor
) -> torch.Tensor:
    """The ``[b]`` std the KL term divides by: the step's ``std_dev_t``, except for DanceGRPO with
    ``flowgrpo.dance_kl: verl_omni``, whose KL is the Gaussian KL of the two steps: ``eta sqrt(sigma - sigma')``,
    the std of the step's noise (verl-omni's ``dance_sde`` returns that std and divides by it). flow_grpo's SDE
    KL has no ``dt`` factor either (its ``std_t`` leaves ``sqrt(-dt)`` out); ``dance_kl: flow_grpo`` keeps that
    scale (``eta``), a KL ``1 / (sigma - sigma')`` times smaller."""
    if rule.sde_type != "dance" or g.dance_kl != "verl_omni":
        return std_dev_t
    sigmas = schedule.sigmas.to(device=steps.device, dtype=std_dev_t.dtype)
    return std_dev_t * torch.sqrt(sigmas[steps] - sigmas[steps + 1])


def window_step_loss(
    engine: FSDPEngine,
    _batch: Any,
    *,
    adapter: Any,
    schedule: Schedule,
    rule: StepRule,
    g: FlowGRPOConfig,
    traj: Trajectory,
    k: int,
    idx: torch.Tensor,
    cond: dict[str, Any],
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    normalizer: float,
    cfg_batch: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss (+ KL to the adapters-off reference) of the k-th trained step of samples ``idx``
    (the ``loss_fn`` form ``FSDPEngine.forward_backward`` takes; the engine's batch argument is unused)."""
    steps, latents, next_latents = traj.step_latents(idx, k)

    def evaluate():
        return evaluate_window_step(
            engine, adapter, latents, next_latents, schedule, steps, cond, rule, g.cfg_scale, cfg_batch
        )

    step = evaluate()
    kl_args = {}
    if g.kl_coef > 0:
        with torch.no_grad(), engine.adapters_disabled(), comm_phase("reference"):
            ref = evaluate()  # the reference policy: the base model, adapters off
        kl_args = dict(
            prev_sample_mean=step.prev_sample_mean,
            ref_prev_sample_mean=ref.prev_sample_mean,
            std_dev_t=kl_std(rule, g, step.std_dev_t, schedule, steps),
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
    schedule: Schedule,
    rule: StepRule,
    g: FlowGRPOConfig,
    traj: Trajectory,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    cond_of: CondFn,
    shuffle_seed: int,
    indices: torch.Tensor | None = None,
    cfg_batch: bool = True,
    hold_params: bool = False,
) -> dict[str, float]:
    """``g.inner_epochs`` passes over the rollout's samples ``indices`` (default: all) in ``g.mini_batches``
    optimizer steps; metrics averaged over every (micro-batch, trained step), plus the last step's optimizer
    metrics (grad norm, lr). ``old_log_probs`` is ``[B, T]``, aligned with ``traj.steps()``. ``hold_params``: each
    optimizer step's micro-steps run on parameters gathered once (``update.gather_params``)."""
    if indices is None:
        indices = torch.arange(traj.latents.shape[0])
    indices = indices.cpu()  # host indices (from the host-side selection): shuffled and cut on the host
    device = traj.latents.device
    num_trained = traj.steps().shape[1]
    sums: dict[str, Any] = {}  # on the device: read once, at the end
    count = 0
    optim_metrics: dict[str, float] = {}
    for epoch in range(g.inner_epochs if indices.numel() else 0):
        perm = indices[
            torch.randperm(indices.numel(), generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        ]
        for mini in perm.chunk(g.mini_batches):
            micros = mini.split(g.micro_batch_size)
            normalizer = float(len(micros) * num_trained)
            engine.zero_grad()
            # held: gathered at the first micro-step, resharded before the optimizer changes the shards
            with engine.gathered_params(backward=True) if hold_params else contextlib.nullcontext():
                for micro in micros:
                    idx = to_device(micro, device)
                    cond = cond_of(idx)
                    for k in range(num_trained):
                        loss_fn = functools.partial(
                            window_step_loss,
                            adapter=adapter,
                            schedule=schedule,
                            rule=rule,
                            g=g,
                            traj=traj,
                            k=k,
                            idx=idx,
                            cond=cond,
                            advantages=advantages,
                            old_log_probs=old_log_probs,
                            normalizer=normalizer,
                            cfg_batch=cfg_batch,
                        )
                        # two experts: the one that runs this step (the same on every rank: experts.py)
                        for key, value in route(engine, traj.host_step(k)).forward_backward(None, loss_fn).items():
                            if isinstance(value, float) or (torch.is_tensor(value) and value.numel() == 1):
                                sums[key] = sums.get(key, 0.0) + value
                        count += 1
            optim_metrics = engine.optimizer_step()  # one read per optimizer step: the gradient norm
    out = fetch_scalars({k: v / max(1, count) for k, v in sums.items()})  # and one for the update's metrics
    out.update(optim_metrics)
    out["trained_samples"] = float(indices.numel())
    return out
