"""GRPO-Guard and per-sample SDE windows on real gloo ranks: one update on a fixed trajectory (each sample its own
window, so a micro-batch's rows sit at different sigmas), and a fresh rollout's first update (on-policy). Each
function returns plain data; the parent (tests/test_grpo_guard_sp.py) asserts."""

from __future__ import annotations

import torch

from tests.workers.engine_steps import _config, _full, _quiet, _trainer, update_batch

G = 8  # samples (dp 1 in every layout here: the micro-batches, and so the guard's micro-batch means, are the same)
W = 2
STARTS = [0, 4, 2, 1, 3, 0, 4, 2]  # per-sample windows of 2 in 6 steps: both ends and between
# the normalised ratio's distance from 1, (log p - log p_old + b) S: inside (2e-4) or outside (8e-3) the clip range
# 1e-3 by a factor >= 2 after S varies across a micro-batch's rows (at most 2x here), so fp32 rounding across
# layouts cannot flip a clipping decision
TARGETS = torch.tensor([2e-4, -2e-4, 8e-3, -8e-3])


def _guard_config(sp: int, ring: int, **flowgrpo):
    keys = dict(
        algorithm="grpo_guard", sde_steps="window", per_sample_windows=True, window_range=[0, 5], noise_level=0.7
    )
    keys.update(flowgrpo)
    return _config(sp, False, ring=ring, **keys)


def _fixed_data(trainer) -> dict:
    g = torch.Generator().manual_seed(42)
    from sp_diffusers.flowgrpo.models.text import DEFAULT_PROMPTS

    prompts = [DEFAULT_PROMPTS[i] for i in torch.randint(len(DEFAULT_PROMPTS), (G,), generator=g).tolist()]
    shape = trainer.adapter.latent_shape(G)
    return {
        "prompts": prompts,
        "latents": torch.randn(G, W + 1, *shape[1:], generator=g),
        "advantages": torch.randn(G, generator=g),
        "target": TARGETS[torch.randint(4, (G, W), generator=g)],
        "drift": 2e-3 * torch.randn(G, W, *shape[1:], generator=g),  # the old means: the current ones moved a bit
    }


def _guard_old(step, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The old log-prob that puts GRPO-Guard's normalised ratio at 1 + target (before the mean-drift bias)."""
    return step.log_prob - target / scale


def _guard_batch(trainer, data: dict, old_of=_guard_old):
    """The batch, a per-sample-window trajectory sampled from the current policy (each next latent its step's mean
    plus the step's noise, so log-probs are O(1) as a rollout's: off-policy random latents make them O(100) and their
    fp32 rounding would dominate the comparison), and the old policy's log-probs and means set from the current
    policy's, so that every normalised ratio lands at 1 + its target."""
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler, evaluate_step
    from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

    engine = trainer.engine
    batch = update_batch(trainer, data["prompts"], shuffle_seed=7)
    starts = torch.tensor(STARTS, device=engine.device)
    latents = data["latents"].to(engine.device).clone()
    traj = Trajectory(
        latents,
        torch.zeros(G, W),
        0,
        latents[:, -1],
        train_steps=starts[:, None] + torch.arange(W, device=engine.device),
        starts=starts,
    )
    everyone = torch.arange(G, device=engine.device)
    sigmas = trainer.schedule.sigmas

    def evaluate(k):
        steps, x, nxt = traj.step_latents(everyone, k)
        sampler = Sampler(engine, trainer.adapter, trainer.schedule)
        step = evaluate_step(sampler, x, nxt, steps, batch.cond, trainer.rule)
        return step, step.std_dev_t * torch.sqrt(sigmas[steps] - sigmas[steps + 1])  # this row's S

    old, means = [], []
    with engine.eval_mode():
        for k in range(W):  # sample the window: x_{k+1} = mean_k + S_k eps (data["latents"][:, k + 1] as eps)
            step, scale = evaluate(k)
            latents[:, k + 1] = (
                step.prev_sample_mean + scale.view(-1, *[1] * (latents.ndim - 2)) * latents[:, k + 1]
            )
        for k in range(W):
            step, scale = evaluate(k)
            old.append(old_of(step, data["target"][:, k], scale))
            means.append(step.prev_sample_mean + data["drift"][:, k])
    traj.old_means = torch.stack(means, dim=1)
    return batch, traj, data["advantages"], torch.stack(old, dim=1)


def captured_update(trainer, batch, traj, adv, old) -> tuple[dict, dict, dict]:
    """``trainer.update`` with the gradients and parameters just before its optimizer step captured:
    ``(metrics, {"grads", "before"}, parameters after)``."""
    engine = trainer.engine
    captured: dict = {}
    original_step = engine.optimizer_step

    def capture_then_step():
        captured["grads"] = {n: _full(p.grad) for n, p in engine.model.named_parameters() if p.grad is not None}
        captured["before"] = {n: _full(p) for n, p in engine.model.named_parameters()}
        return original_step()

    engine.optimizer_step = capture_then_step
    metrics = trainer.update(batch, traj, adv, old)
    return metrics, captured, {n: _full(p) for n, p in engine.model.named_parameters()}


def guard_update(rank: int, world: int, sp: int, ring: int = 1) -> dict:
    """One GRPO-Guard update (4 micro-batches x 2 trained steps, one optimizer step) on this layout, and a fresh
    rollout's first update (ratio exactly 1) for the full-SDE rollout and for per-sample windows."""
    _quiet()
    trainer = _trainer(_guard_config(sp, ring))
    batch, traj, adv, old = _guard_batch(trainer, _fixed_data(trainer))
    metrics, captured, params = captured_update(trainer, batch, traj, adv, old)
    out = {
        "loss": metrics["loss"],
        "clipfrac": metrics["clipfrac"],
        "ratio_mean_bias": metrics["ratio_mean_bias"],
        "step_moved": max((params[n] - captured["before"][n]).abs().max().item() for n in params),
        "grads": captured["grads"] if rank == 0 else None,
        "params": params if rank == 0 else None,
        "on_policy": {},
    }
    for name, keys in (
        ("all", dict(sde_steps="all", per_sample_windows=False)),
        ("all_rollout_means", dict(sde_steps="all", per_sample_windows=False, recompute_old_log_probs=False)),
        ("per_sample_windows", {}),
        # micro-batches of 2 of the 8 samples: the old log-probs are recomputed on the same micro-batches
        ("micro_batches_of_2", dict(sde_steps="all", per_sample_windows=False, micro_batch_size=2)),
    ):
        keys = {"micro_batch_size": 8, **keys}
        fresh = _trainer(_guard_config(sp, ring, prompts_per_rank=2, group_size=4, **keys))
        fresh_batch = fresh.iteration_batch(0).prepared(fresh.engine)
        traj, adv, old, _ = fresh.collect(fresh_batch)
        m = fresh.update(fresh_batch, traj, adv, old)
        out["on_policy"][name] = {
            k: m[k]
            for k in ("ratio_mean", "ratio_std", "ppo_kl", "clipfrac", "ratio_mean_bias", "trained_samples")
        } | {"trained_steps": traj.steps().shape[1], "distinct_starts": len(set(traj.steps()[:, 0].tolist()))}
    return out
