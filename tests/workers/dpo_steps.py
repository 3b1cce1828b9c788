"""Online Diffusion-DPO on real gloo ranks: the rollout and its pairs, then one update on layout-independent pairs.
Each function returns plain data; the parent (tests/test_diffusion_dpo_sp.py) asserts."""

from __future__ import annotations

import torch

from tests.workers.engine_steps import _config, _full, _quiet, _trainer, update_batch
from tests.workers.guard_steps import captured_update

G = 8  # samples of the update: 4 pairs, chosen first
BETA = 100.0  # verl-omni's online recipe


def dpo_step(rank: int, world: int, sp: int, ring: int, lora: bool = True) -> dict:
    """A rollout (Euler, the trained policy) scored and paired, then one Diffusion-DPO update (2 micro-batches of 2
    pairs, one optimizer step) on fixed pairs: LoRA with random A and B (the policy is not the reference), or full
    fine-tuning against the frozen copy of the initial weights (then policy = reference at the first step)."""
    _quiet()
    import sp_diffusers
    from sp_diffusers.flowgrpo.models.text import DEFAULT_PROMPTS
    from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

    config = _config(
        sp, lora, ring=ring, algorithm="diffusion_dpo", num_steps=6, micro_batch_size=4, window_range=[0, 4],
        **{"dpo.beta": BETA},
    )
    config.flowgrpo.prompts_per_rank, config.flowgrpo.group_size = 2, 3
    trainer = _trainer(config)
    engine = trainer.engine
    batch = trainer.iteration_batch(0).prepared(engine)
    traj, labels, _, stats = trainer.collect(batch)
    rollout = {"final": traj.final.cpu(), "stored": tuple(traj.latents.shape), "labels": labels.cpu().tolist(),
               "kept": batch.kept.tolist(), "reward_mean": stats["reward_mean"]}
    # the update on layout-independent pairs
    g = torch.Generator().manual_seed(42)
    prompts = [DEFAULT_PROMPTS[i] for i in torch.randint(len(DEFAULT_PROMPTS), (G // 2,), generator=g).tolist()]
    x0 = torch.randn(trainer.adapter.latent_shape(G), generator=g).to(engine.device)
    batch = update_batch(trainer, [p for p in prompts for _ in range(2)], shuffle_seed=7)
    batch.kept = torch.arange(G)
    traj = Trajectory(x0.new_zeros((G, 0, *x0.shape[1:])), x0.new_zeros((G, 0)), 0, x0)
    traj.train_steps, traj.noise_seed = torch.zeros(G, 1, dtype=torch.long, device=engine.device), 11
    labels = torch.tensor([1.0, -1.0] * (G // 2), device=engine.device)
    metrics, captured, params = captured_update(trainer, batch, traj, labels, torch.zeros(G, 0))
    grads, before = captured["grads"], captured["before"]
    params = {n: params[n] for n in grads}
    trainer.algorithm.attach(engine)  # as after a checkpoint load: the reference stays the weights the run began from
    frozen = trainer.algorithm.frozen
    reference_moved = None
    if frozen is not None:  # the reference is the initial weights, before and after the step and a reload
        ref = {n: _full(p) for n, p in frozen.engine.model.named_parameters()}
        reference_moved = max((ref[n] - before[n].to(ref[n].dtype)).abs().max().item() for n in grads)
    return {
        "package": sp_diffusers.__file__,
        "rollout": rollout,
        "loss": metrics["loss"],
        "metrics": {k: metrics[k] for k in ("implicit_acc", "implicit_reward_margin", "trained_samples", "model_error")},
        "step_moved": max((params[n] - before[n]).abs().max().item() for n in params),
        "grads": grads if rank == 0 else None,
        "params": params if rank == 0 else None,
        "reference_moved": reference_moved,
    }
