"""Video RL on real gloo ranks: DanceGRPO and CPS under SP (on-policy ratio, rollout vs one process) and the
zero-advantage filter under dp x SP. Each function returns plain data; the parent asserts."""

from __future__ import annotations

import tempfile

import torch

from tests.workers.engine_steps import _full, _quiet


def _config(sp: int, **flowgrpo):
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    c.model.kind, c.model.image_size, c.model.frames, c.model.overrides = "wan", 8, 2, {"num_layers": 2}
    c.text.max_sequence_length = 16
    c.parallel.ulysses_sequence_parallel_size = sp
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 6, 2, [0, 3]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 2, 2, 4
    c.flowgrpo.recompute_old_log_probs = False  # old log-probs from the rollout itself: the ratio must be 1
    c.flowgrpo.reward = "video_color"
    c.train.out_dir, c.train.progress, c.train.plot = tempfile.mkdtemp(), False, False
    for k, v in flowgrpo.items():  # an algorithm's section: mix={"window_size": 2}, or "mix.window_size"=2
        if isinstance(v, dict):
            for key, value in v.items():
                setattr(getattr(c.flowgrpo, k), key, value)
        elif "." in k:
            section, key = k.split(".")
            setattr(getattr(c.flowgrpo, section), key, v)
        else:
            setattr(c.flowgrpo, k, v)
    return c


def _trainer(config):
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    torch.manual_seed(1234)
    return FlowGRPOTrainer(config)


RUNS = {
    # DanceGRPO on Wan (built-in UMT5, prompts zero-padded to 16 tokens): its SDE on all 6 steps, 3 trained
    "dance": dict(algorithm="dance_grpo", noise_level=0.3, shift=3.0, timestep_fraction=0.6),
    # flow_grpo's CPS step on Wan with ragged byte-level prompts (padded by the engine, zeroed by the adapter)
    "cps": dict(sde_type="cps", noise_level=0.8),
}


def algorithms(rank: int, world: int, sp: int) -> dict:
    """For each run: a fresh rollout then the first update (ratio, ppo_kl) and the rollout of dp rank 0."""
    _quiet()
    out: dict = {}
    for name, flowgrpo in RUNS.items():
        config = _config(sp, **flowgrpo)
        if name == "cps":
            config.text.encoder = "byte"
        trainer = _trainer(config)
        batch = trainer.iteration_batch(0).prepared(trainer.engine)
        traj, adv, old, _ = trainer.collect(batch)
        metrics = trainer.update(batch, traj, adv, old)
        out[name] = {
            "ratio_mean": metrics["ratio_mean"],
            "ratio_std": metrics["ratio_std"],
            "ppo_kl": metrics["ppo_kl"],
            "clipfrac": metrics["clipfrac"],
            "grad_norm": metrics["grad_norm"],
            "trained_steps": traj.steps().shape[1],
            "text_lengths": [int(m.sum()) for m in batch.cond["prompt_embeds_mask"]],
            "dp_rank": trainer.engine.dp_rank,
            "final": traj.final.cpu(),
            "log_probs": traj.log_probs.cpu(),
            "schedule": trainer.schedule.source,
        }
    return out


def zero_advantage_filter(rank: int, world: int, sp: int) -> dict:
    """dp 2 x SP 2, 2 prompts x 2 samples per dp rank. dp rank 0: group 0 constant, group 1 varied; dp rank 1:
    constant. So rank 0 has 2 non-zero advantages, rank 1 none: both must train K = 2 samples in the same number
    of micro-batches and optimizer steps (rank 1 tops up with its zero ones). Then every reward constant: no
    update on any rank."""
    _quiet()
    trainer = _trainer(_config(sp, micro_batch_size=1))
    dp = trainer.engine.dp_rank

    def reward(latents, prompts):
        r = torch.full((latents.shape[0],), 0.5)
        if dp == 0:
            r[2:] = latents[2:].float().flatten(1).mean(dim=1).cpu()
        return r

    trainer.reward = reward
    first = trainer.train_iteration(0)
    batch = trainer.iteration_batch(1).prepared(trainer.engine)
    kept_check = trainer.collect(batch)[3]
    kept = batch.kept.tolist()
    step_after_first = trainer.engine.global_step
    before = {n: _full(p) for n, p in trainer.engine.model.named_parameters()}
    trainer.reward = lambda latents, prompts: torch.full((latents.shape[0],), 0.25)
    second = trainer.train_iteration(2)
    moved = max((before[n] - _full(p)).abs().max().item() for n, p in trainer.engine.model.named_parameters())
    return {
        "dp_rank": dp,
        "sp_rank": trainer.engine.sp_rank,
        "first": {k: first[k] for k in ("trained_samples", "zero_advantage_fraction", "step_skipped")},
        "kept": kept,
        "zero_fraction_again": kept_check["zero_advantage_fraction"],
        "global_step_after_first": step_after_first,
        "second": {k: second[k] for k in ("trained_samples", "step_skipped", "loss", "grad_norm")},
        "global_step_after_second": trainer.engine.global_step,
        "moved_by_second": moved,
    }
