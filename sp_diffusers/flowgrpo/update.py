"""The policy update: mini-batches x micro-batches x trained steps, one backward per trained step.

For each shuffled mini-batch (one optimizer step) the engine accumulates, over its micro-batches and the T
trained steps of each (the algorithm's: FlowGRPO's W window steps, DanceGRPO's per-sample subsets), the gradient
of the algorithm's loss ``/ (micro-batches x T)``: the mean over the mini-batch and the trained steps, as
flow_grpo, DanceGRPO (``/ (gradient_accumulation_steps * train_timesteps)``) and verl-omni average it. Each trained
step runs the model here (:func:`evaluate_trained_step`, on what ``Algorithm.inputs`` declares) and hands the
result to ``Algorithm.loss``; nothing here knows which algorithm runs.

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

from ..engine.protocols import TrainingEngine
from ..parallel.devices import fetch_scalars, to_device
from ..parallel.ledger import comm_phase
from .algorithms.base import Algorithm, StepContext, StepInputs, Targets
from .models.experts import route
from .sampling.denoise import evaluate_step, velocity
from .sampling.trajectory import Trajectory

__all__ = ["evaluate_trained_step", "micro_batches", "policy_update", "step_loss"]

CondFn = Callable[[torch.Tensor], dict[str, Any]]  # host sample indices -> the conditioning of those samples


def micro_batches(
    indices: torch.Tensor, mini_batches: int, micro_batch_size: int, seed: int, unit: int = 1
) -> list[tuple]:
    """One pass's mini-batches (one optimizer step each), each a tuple of micro-batches of host sample indices:
    ``indices`` shuffled by ``seed``, cut into ``mini_batches`` chunks, each split into ``micro_batch_size``.
    ``unit``: consecutive indices that move as one (2: Diffusion-DPO's chosen, rejected pairs; ``micro_batch_size``
    a multiple of it). The recomputed old log-probs run the first pass's micro-batches too, so that a trained step
    repeats their arithmetic bit for bit (the same GEMM shapes; docs/training.md, "The on-policy ratio")."""
    if indices.numel() % unit or micro_batch_size % unit:
        raise ValueError(
            f"micro_batches: {indices.numel()} samples and micro_batch_size={micro_batch_size} must be multiples of "
            f"the unit {unit} (pairs stay in one micro-batch)"
        )
    units = indices.reshape(-1, unit)
    perm = units[torch.randperm(units.shape[0], generator=torch.Generator().manual_seed(seed))]
    return [mini.flatten().split(micro_batch_size) for mini in perm.chunk(mini_batches)]


def evaluate_trained_step(
    engine: TrainingEngine, algorithm: Algorithm, ctx: StepContext, traj: Trajectory, k: int, idx: torch.Tensor, cond: dict
) -> StepInputs:
    """The k-th trained step of samples ``idx`` under ``engine``'s policy, as ``algorithm.inputs()`` declares it:
    the stored SDE transition's log-prob and step mean (and the adapters-off reference's mean), or the velocities at
    the final data noised to the step's sigma (the policy's, the old policy's, the reference's)."""
    wants = algorithm.inputs()
    if wants.evaluation == "forward_process":
        x0 = traj.final[idx].float()
        steps = traj.steps()[idx, k]
        t, timestep, noise = algorithm.forward_point(traj, k, idx, ctx.schedule.on(x0.device))
        t, noise = t.to(x0.dtype), noise.to(x0.dtype)
        tt = t.reshape(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - tt) * x0 + tt * noise

        def v_of(e: Any) -> torch.Tensor:
            return velocity(e, ctx.adapter, x_t, timestep, cond)  # the forward process trains without guidance

        v_old = v_ref = None
        if wants.old_velocity:
            with torch.no_grad(), comm_phase("old_log_probs"):  # the old policy's pass
                v_old = v_of(algorithm.rollout_engine(engine))
        v = v_of(engine)
        if wants.reference:
            with torch.no_grad(), algorithm.reference_policy(engine) as reference, comm_phase("reference"):
                v_ref = v_of(reference)
        return StepInputs(steps, x0=x0, x_t=x_t, t=t, noise=noise, v=v, v_old=v_old, v_ref=v_ref)
    steps, latents, next_latents = traj.step_latents(idx, k)
    sampler = ctx.sampler(engine)
    step = evaluate_step(sampler, latents, next_latents, steps, cond, ctx.rule)
    # the schedule's copy on the device, indexed there: the (per-sample) steps never travel to the host
    sigmas = ctx.schedule.on(steps.device).sigmas.to(step.std_dev_t.dtype)
    ref = None
    if wants.reference:
        with torch.no_grad(), algorithm.reference_policy(engine) as reference, comm_phase("reference"):
            ref = evaluate_step(ctx.sampler(reference), latents, next_latents, steps, cond, ctx.rule).prev_sample_mean
    return StepInputs(
        steps,
        log_prob=step.log_prob,
        prev_sample_mean=step.prev_sample_mean,
        std_dev_t=step.std_dev_t,
        sqrt_dt=torch.sqrt(sigmas[steps] - sigmas[steps + 1]),
        ref_prev_sample_mean=ref,
    )


def step_loss(
    engine: Any,
    _batch: Any = None,
    *,
    algorithm: Algorithm,
    ctx: StepContext,
    traj: Trajectory,
    k: int,
    idx: torch.Tensor,
    cond: dict,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    normalizer: float,
    kl_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One trained step's loss and metrics, in the ``loss_fn(engine, batch)`` form ``forward_backward`` takes: the
    step evaluated (:func:`evaluate_trained_step`), the targets the rollout fixed, ``algorithm.loss``."""
    wants = algorithm.inputs()
    targets = Targets(
        advantages[idx, k] if advantages.ndim == 2 else advantages[idx],  # [B, T]: per-step (flowgrpo.kl_reward)
        old_log_probs[idx, k] if wants.old_log_probs else None,
        traj.old_step_means(idx, k) if wants.old_means else None,
        kl_rows[idx] if kl_rows is not None else None,
    )
    return algorithm.loss(evaluate_trained_step(engine, algorithm, ctx, traj, k, idx, cond), targets, normalizer)


def policy_update(
    engine: TrainingEngine,
    algorithm: Algorithm,
    ctx: StepContext,
    traj: Trajectory,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    cond_of: CondFn,
    shuffle_seed: int,
    indices: torch.Tensor | None = None,
    hold_params: bool = False,
    kl_rows: torch.Tensor | None = None,
) -> dict[str, float]:
    """``g.inner_epochs`` passes over the rollout's samples ``indices`` (default: all) in ``g.mini_batches``
    optimizer steps; metrics averaged over every (micro-batch, trained step), plus the last step's optimizer
    metrics (grad norm, lr). ``old_log_probs`` is ``[B, T]``, aligned with ``traj.steps()``. ``hold_params``: each
    optimizer step's micro-steps run on parameters gathered once (``update.gather_params``). ``kl_rows`` ``[B]``:
    the samples a gated KL applies to (``Algorithm.kl_rows``)."""
    g = ctx.g
    if indices is None:
        indices = torch.arange(traj.latents.shape[0])
    indices = indices.cpu()  # host indices (from the host-side selection): shuffled and cut on the host
    device = traj.latents.device
    num_trained = traj.steps().shape[1]
    if num_trained == 0:  # a rollout with no trained step (an empty window) trains nothing, on every rank alike
        indices = indices[:0]
    sums: dict[str, Any] = {}  # on the device: read once, at the end
    count = 0
    optim_metrics: dict[str, float] = {}
    for epoch in range(g.inner_epochs if indices.numel() else 0):
        unit = 2 if algorithm.pair_units else 1
        for micros in micro_batches(indices, g.mini_batches, g.micro_batch_size, shuffle_seed + epoch, unit):
            normalizer = float(len(micros) * num_trained)
            engine.zero_grad()
            # held: gathered at the first micro-step, resharded before the optimizer changes the shards
            with engine.gathered_params(backward=True) if hold_params else contextlib.nullcontext():
                for micro in micros:
                    idx = to_device(micro, device)
                    cond = cond_of(micro)  # host indices: a host list of the batch (Z-Image's lengths) too
                    for k in range(num_trained):
                        loss_fn = functools.partial(
                            step_loss,
                            algorithm=algorithm,
                            ctx=ctx,
                            traj=traj,
                            k=k,
                            idx=idx,
                            cond=cond,
                            advantages=advantages,
                            old_log_probs=old_log_probs,
                            normalizer=normalizer,
                            kl_rows=kl_rows,
                        )
                        # two experts: the one that runs this step (the same on every rank: experts.py)
                        expert = route(engine, traj.host_step(k))
                        for key, value in expert.forward_backward(None, loss_fn).items():
                            if isinstance(value, float) or (torch.is_tensor(value) and value.numel() == 1):
                                sums[key] = sums.get(key, 0.0) + value
                        count += 1
                    engine.ema_step()  # after every micro-batch, as flow_grpo steps its EMA
            optim_metrics = engine.optimizer_step()  # one read per optimizer step: the gradient norm
    out = fetch_scalars({k: v / max(1, count) for k, v in sums.items()})  # and one for the update's metrics
    out.update(optim_metrics)
    out["trained_samples"] = float(indices.numel())
    return out
