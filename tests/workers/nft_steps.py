"""DiffusionNFT on real gloo ranks: the rollout by the old policy, one update on layout-independent data, and the
old policy's decay after it. Each function returns plain data; the parent (tests/test_diffusion_nft_sp.py) asserts."""

from __future__ import annotations

import torch

from tests.workers.engine_steps import _config, _full, _quiet, _trainer, update_batch

G = 4  # samples (4 prompts; dp 1 in every layout here)
STEPS = 6  # schedule steps: each sample trains int(6 * 0.99) = 5 of them


def _data(trainer) -> dict:
    """Prompts (ragged), final data x0, advantages spanning r in [0, 1] (clipped at both ends, and 1/2), the trained
    steps and the noise seed: the same on every layout."""
    from sp_diffusers.flowgrpo.models.text import DEFAULT_PROMPTS

    g = torch.Generator().manual_seed(42)
    prompts = [DEFAULT_PROMPTS[i] for i in torch.randint(len(DEFAULT_PROMPTS), (G,), generator=g).tolist()]
    x0 = torch.randn(trainer.adapter.latent_shape(G), generator=g)
    advantages = torch.tensor([-7.0, -1.5, 0.0, 2.5])  # r = 0, 0.35, 0.5, 0.75
    steps = torch.stack([torch.randperm(STEPS, generator=g)[:5] for _ in range(G)])
    return {"prompts": prompts, "x0": x0, "advantages": advantages, "steps": steps}


def _old_params(trainer) -> dict:
    return {n: _full(p).float() for n, p in trainer.algorithm.old.engine.model.named_parameters()}


def nft_step(rank: int, world: int, sp: int, ring: int, lora: bool) -> dict:
    """A rollout (old policy, dpm2), then one DiffusionNFT update (2 micro-batches x 5 trained steps, one optimizer
    step) on fixed data, then the old policy's decay; with LoRA the KL to the adapters-off model is on."""
    _quiet()
    import sp_diffusers
    from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

    config = _config(sp, lora, ring=ring, algorithm="diffusion_nft", num_steps=STEPS, kl_coef=0.1 if lora else 0.0)
    config.flowgrpo.prompts_per_rank, config.flowgrpo.group_size = 2, 2
    trainer = _trainer(config)
    engine = trainer.engine
    # the rollout: the old policy samples with the dpm2 solver; only the final data is kept
    batch = trainer.iteration_batch(0).prepared(engine)
    traj, _, old_lp, stats = trainer.collect(batch)
    rollout = {"final": traj.final.cpu(), "stored": tuple(traj.latents.shape), "old_lp": old_lp.abs().max().item()}
    # the update on layout-independent data
    data = _data(trainer)
    batch = update_batch(trainer, data["prompts"], shuffle_seed=7)
    x0 = data["x0"].to(engine.device)
    traj = Trajectory(x0.new_zeros((G, 0, *x0.shape[1:])), x0.new_zeros((G, 0)), 0, x0)
    traj.train_steps, traj.noise_seed = data["steps"].to(engine.device), 11
    before_old = _old_params(trainer)
    captured: dict = {}
    original_step = engine.optimizer_step

    def capture_then_step():
        captured["grads"] = {
            n: _full(p.grad) if p.grad is not None else None for n, p in engine.model.named_parameters() if p.requires_grad
        }
        captured["before"] = {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}
        return original_step()

    engine.optimizer_step = capture_then_step
    metrics = trainer.update(batch, traj, data["advantages"].to(engine.device), torch.zeros(G, 5))
    params = {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}
    decay = trainer.algorithm.after_update(engine, {})["old_policy_decay"]
    after_old = _old_params(trainer)
    return {
        "package": sp_diffusers.__file__,
        "rollout": rollout,
        "reward_mean": stats["reward_mean"],
        "loss": metrics["loss"],
        "metrics": {k: metrics[k] for k in ("policy_loss", "old_deviate", "kl_div", "reward_prob_mean")},
        "step_moved": max((params[n] - captured["before"][n]).abs().max().item() for n in params),
        "grads": captured["grads"] if rank == 0 else None,
        "params": params if rank == 0 else None,
        "before": captured["before"] if rank == 0 else None,
        "decay": decay,
        "old_was_theta": max((before_old[n] - captured["before"][n].float()).abs().max().item() for n in params),
        "old_after": after_old if rank == 0 else None,
        "sp_rank": engine.sp_rank,
    }
