"""MixGRPO on real gloo ranks: a rollout with its DPM-Solver++ tail, one update from identical parameters, and the
on-policy update of a fresh rollout. Returns plain data; tests/test_mix_grpo_sp.py asserts."""

from __future__ import annotations

from tests.workers.engine_steps import _config, _full, _global_data, _my_batch, _quiet, _trainer

# the 1-step-at-a-time window of 2 at step 0 of 10 shifted-linspace steps: L = 1, a tail of int(9 * 0.4) = 3 points
# (one second-order step, one to 0); a KL weight large enough that its gradient (10 * delta, delta <= 3e-3, per
# trained step) is a visible part of the update
MIX = dict(algorithm="mix_grpo", shift=3.0, num_steps=10, noise_level=0.7, recompute_old_log_probs=False, prompts_per_rank=2, group_size=2, mix=dict(window_size=2, tail_solver="dpmsolver++", kl_coef=10.0))


def mix_grpo_step(rank: int, world: int, sp: int, ring: int) -> dict:
    """(a) the rollout of iteration 0 (parameters unchanged), (b) one update of fixed data (2 micro-batches x 2
    window steps, one optimizer step: the parity case of engine_steps.flowgrpo_step, MixGRPO's loss), (c) the
    rollout of iteration 1 and its update, with the micro-batch equal to the rollout batch: on-policy."""
    _quiet()
    trainer = _trainer(_config(sp, False, ring=ring, **MIX))
    engine, g = trainer.engine, trainer.config.flowgrpo
    out: dict = {"dp_rank": engine.dp_rank, "sp_rank": engine.sp_rank}

    batch = trainer.iteration_batch(0).prepared(engine)  # (a)
    traj, _, _, stats = trainer.collect(batch)
    out.update(
        window=(batch.plan.window_start, batch.plan.window_size),
        final=traj.final.cpu(),
        log_probs=traj.log_probs.cpu(),
        reward_mean=stats["reward_mean"],
    )

    batch, traj, adv, old = _my_batch(trainer, _global_data(trainer))  # (b)
    captured: dict = {}
    original_step = engine.optimizer_step

    def capture_then_step():
        captured["grads"] = {
            n: _full(p.grad) if p.grad is not None else None
            for n, p in engine.model.named_parameters()
            if p.requires_grad
        }
        captured["before"] = {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}
        return original_step()

    engine.optimizer_step = capture_then_step
    metrics = trainer.update(batch, traj, adv, old)
    engine.optimizer_step = original_step
    params = {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}
    out.update(
        step_moved=max((params[n] - captured["before"][n]).abs().max().item() for n in params),
        loss=metrics["loss"],
        clipfrac=metrics["clipfrac"],
        kl_loss=metrics["kl_loss"],
        grads=captured["grads"] if rank == 0 else None,
        params=params if rank == 0 else None,
        n_trainable=len(params),
    )

    g.micro_batch_size = g.prompts_per_rank * g.group_size  # (c): the training forward is the rollout's
    batch = trainer.iteration_batch(1).prepared(engine)
    traj, adv, old, _ = trainer.collect(batch)
    metrics = trainer.update(batch, traj, adv, old)
    out["on_policy"] = {
        k: metrics.get(k)
        for k in ("ratio_mean", "ratio_std", "ppo_kl", "clipfrac", "kl_loss", "trained_samples")
    }
    out["on_policy"]["window"] = (batch.plan.window_start, batch.plan.window_size, traj.latents.shape[1])
    out["cur_timesteps"] = trainer.algorithm.iteration_metrics(batch.plan)["cur_timesteps"]
    return out
