"""FSDPEngine + FlowGRPO on real gloo ranks: one training step per layout, rollouts, on-policy ratio,
checkpoint resume, and SP divergence detection. Each function returns plain data; the parent asserts."""

from __future__ import annotations

import logging
import tempfile

import torch
import torch.distributed as dist

from tests._parity import PARITY_EPS, PARITY_LR

G = 8  # global samples (2 prompts x group 4 per dp rank at dp = 2)
W = 2


def _quiet() -> None:
    import warnings

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _config(
    sp: int,
    lora: bool,
    out_dir: str = "",
    kind: str = "qwenimage",
    ring: int = 1,
    pipeline: str = "",
    replicate: int = 1,
    **flowgrpo,
):
    """``pipeline``: the folder of the ``*_pipeline`` kinds, written by the parent before the ranks start
    (``save_tiny_pipeline(family, folder, num_layers=2)``; see tests/test_engine.py for why not here)."""
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    c.model.kind, c.model.image_size, c.model.overrides = kind, 8, {"num_layers": 2}
    if kind.endswith("_pipeline") and not pipeline:
        raise ValueError(f"kind={kind!r} reads a pipeline folder: pass pipeline=<folder written by the parent>")
    if kind == "sd3_pipeline":
        # a real StableDiffusion3Pipeline folder: transformer from_pretrained, prompts through its CLIP-L,
        # CLIP-G (pooled) and T5 encoders; 77 + 16 = 93 text tokens, padded to 94 at SP = 2 (one masked key)
        c.model.kind, c.model.pretrained = "sd3", f"{pipeline}/transformer"
        c.text.pipeline, c.text.max_sequence_length = pipeline, 16
    if kind == "wan_pipeline":
        # a real WanPipeline folder: transformer from_pretrained, prompts through its UMT5 (zero-padded to 16 tokens,
        # all attended: Wan takes no text mask), its UniPC scheduler config as the schedule; 2 x 4 x 4 = 32 video tokens
        c.model.kind, c.model.pretrained, c.model.frames = "wan", f"{pipeline}/transformer", 2
        c.text.pipeline, c.text.max_sequence_length = pipeline, 16
    if kind == "zimage_pipeline":
        # a real ZImagePipeline folder: transformer from_pretrained (lists in, a list out), prompts through its Qwen3
        # chat template (each caption's valid tokens), its scheduler config; 6 heads: Ulysses 2 and 3 divide them
        c.model.kind, c.model.pretrained = "zimage", f"{pipeline}/transformer"
        c.text.pipeline, c.text.max_sequence_length = pipeline, 64
    if kind in ("flux2_klein_pipeline", "flux2_dev_pipeline"):
        # a real Flux2KleinPipeline folder: transformer from_pretrained (packed 2 x 2 tokens, batched 4-axis ids, no
        # guidance embedding), prompts through its chat template and Qwen3's stacked layers 9 / 18 / 27 (64 rows, all
        # attended), its scheduler config and compute_empirical_mu; 6 heads: Ulysses 2 and 3 divide them. A
        # Flux2Pipeline ([dev]) folder: Mistral3's layers 10 / 20 / 30 after its system message, and the guidance
        # embedding's input (the pipeline's default 4)
        c.model.kind, c.model.pretrained = "flux2", f"{pipeline}/transformer"
        c.text.pipeline, c.text.max_sequence_length = pipeline, 64
    if kind == "hunyuanvideo15_pipeline":
        # a real HunyuanVideo15Pipeline folder: video latents with zero condition channels, two text streams (the
        # MLLM's valid rows and byT5's one masked row: no quoted text), 729 zero image tokens, its scheduler config
        # and linspace sigmas; 6 heads: Ulysses 2 and 3 divide them; 2 latent frames of 8 x 8
        c.model.kind, c.model.pretrained, c.model.frames = "hunyuanvideo15", f"{pipeline}/transformer", 2
        c.text.pipeline = pipeline
    if kind == "ltx2_pipeline":
        # a real LTX2Pipeline folder: video and audio tokens in one latent tensor (2 x 8 x 8 = 128 video + 5 audio),
        # both text streams through its Gemma3 and connectors (64 rows, the registers fill the padding), its scheduler
        # config and shift over the video tokens; 6 heads per stream: Ulysses 2 and 3 divide them
        c.model.kind, c.model.pretrained, c.model.frames, c.model.audio_frames = "ltx2", f"{pipeline}/transformer", 2, 5
        c.text.pipeline, c.text.max_sequence_length = pipeline, 64
    c.parallel.ulysses_sequence_parallel_size = sp
    c.parallel.ring_degree = ring
    c.parallel.dp_replicate = replicate
    c.lora.enabled = lora
    c.lora.init = False  # random A and B, so both get non-zero gradients at the first step
    c.optim.lr, c.optim.eps = PARITY_LR, PARITY_EPS  # a well-conditioned first AdamW step (tests/_parity.py)
    c.optim.max_grad_norm = 1e9  # the step itself is compared; clipping is tested elsewhere
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 6, W, [1, 2]
    c.flowgrpo.micro_batch_size = 2
    c.flowgrpo.clip_range = 1e-3
    c.train.out_dir = out_dir or tempfile.mkdtemp()
    c.train.progress = False
    c.train.plot = False
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

    torch.manual_seed(1234)  # LoRA adapters draw their initial weights from the global RNG
    return FlowGRPOTrainer(config)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


def _global_data(trainer) -> dict:
    """Layout-independent training data: prompts (ragged), a fixed trajectory, advantages, perturbations."""
    from sp_diffusers.flowgrpo.models.text import DEFAULT_PROMPTS

    g = torch.Generator().manual_seed(42)
    prompts = [DEFAULT_PROMPTS[i] for i in torch.randint(len(DEFAULT_PROMPTS), (G,), generator=g).tolist()]
    shape = trainer.adapter.latent_shape(G)
    latents = torch.randn(G, W + 1, *shape[1:], generator=g)
    advantages = torch.randn(G, generator=g)
    # old log-prob = current log-prob - delta: |ratio - 1| = 5e-4 (inside the clip range) or 3e-3 (clipped),
    # both far from the 1e-3 boundary, so fp32 rounding across layouts cannot flip a clipping decision.
    delta = torch.tensor([5e-4, -5e-4, 3e-3, -3e-3])[torch.randint(4, (G, W), generator=g)]
    return {"prompts": prompts, "latents": latents, "advantages": advantages, "delta": delta}


def update_batch(trainer, prompts: list[str], shuffle_seed: int):
    """A prepared batch of ``prompts`` for an update on a trajectory made by hand (no rollout: no noise, no plan)."""
    from sp_diffusers.flowgrpo.batch import IterationBatch

    n = len(prompts)
    cond = trainer.text_encoder.encode_batch(prompts)
    return IterationBatch(prompts, cond, torch.arange(n), torch.zeros(n), shuffle_seed=shuffle_seed).prepared(
        trainer.engine
    )


def _my_batch(trainer, data: dict) -> tuple[dict, object, torch.Tensor, torch.Tensor]:
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler, evaluate_step
    from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

    engine = trainer.engine
    n = G // engine.dp_size
    sl = slice(engine.dp_rank * n, (engine.dp_rank + 1) * n)
    prompts = data["prompts"][sl]
    batch = update_batch(trainer, prompts, shuffle_seed=7)
    traj = Trajectory(data["latents"][sl].to(engine.device), torch.zeros(n, W), 1, data["latents"][sl, -1])
    with engine.eval_mode():
        current = torch.stack(
            [
                evaluate_step(
                    Sampler(engine, trainer.adapter, trainer.schedule),
                    traj.latents[:, k],
                    traj.latents[:, k + 1],
                    traj.window_start + k,
                    batch.cond,
                    trainer.rule,
                ).log_prob
                for k in range(W)
            ],
            dim=1,
        )
    old = current - data["delta"][sl]
    return batch, traj, data["advantages"][sl], old


def flowgrpo_step(
    rank: int,
    world: int,
    sp: int,
    lora: bool,
    kind: str = "qwenimage",
    ring: int = 1,
    pipeline: str = "",
    replicate: int = 1,
) -> dict:
    """One FlowGRPO update (2 micro-batches x 2 window steps, one optimizer step) on this layout (``replicate``:
    HSDP's replica groups)."""
    _quiet()
    trainer = _trainer(_config(sp, lora, kind=kind, ring=ring, pipeline=pipeline, replicate=replicate))
    engine = trainer.engine
    data = _global_data(trainer)
    batch, traj, adv, old = _my_batch(trainer, data)
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
    params = {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}
    return {
        "step_moved": max((params[n] - captured["before"][n]).abs().max().item() for n in params),
        "dp_rank": engine.dp_rank,
        "sp_rank": engine.sp_rank,
        "loss": metrics["loss"],
        "clipfrac": metrics["clipfrac"],
        "grads": captured["grads"] if rank == 0 else None,
        "params": params if rank == 0 else None,
        "n_trainable": len(params),
        "replicate": engine.layout.replicate,
    }


def on_policy_and_rollout(rank: int, world: int, sp: int) -> dict:
    """A fresh rollout with ragged prompts, then the first update: ratio 1, ppo_kl 0 (old log-probs from the
    rollout itself, not recomputed). Also returns the rollout for comparison with one process."""
    _quiet()
    trainer = _trainer(
        _config(
            sp, False, recompute_old_log_probs=False, prompts_per_rank=2, group_size=2, micro_batch_size=4
        )
    )
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    trainer.config.rollout.chunks = 3  # 2 + 1 + 1 of the 4 samples, each scored in the background
    chunked, chunked_adv, _, chunked_stats = trainer.collect(batch)
    trainer.config.rollout.chunks = 1
    traj, adv, old, stats = trainer.collect(batch)
    lengths = [int(m.sum()) for m in batch.cond["prompt_embeds_mask"]]
    metrics = trainer.update(batch, traj, adv, old)
    return {
        "ratio_mean": metrics["ratio_mean"],
        "ratio_std": metrics["ratio_std"],
        "ppo_kl": metrics["ppo_kl"],
        "clipfrac": metrics["clipfrac"],
        "text_lengths": lengths,
        "padded_len": batch.cond["prompt_embeds"].shape[1],
        "final": traj.final.cpu(),
        "log_probs": traj.log_probs.cpu(),
        "reward_mean": stats["reward_mean"],
        "advantages": adv.cpu(),
        "chunked": {
            "final": chunked.final.cpu(),
            "log_probs": chunked.log_probs.cpu(),
            "advantages": chunked_adv.cpu(),
            "reward_mean": chunked_stats["reward_mean"],
            "timed": "reward_wait_seconds" in chunked_stats and "reward_wait_seconds" not in stats,
        },
    }


def checkpoint_resume(rank: int, world: int, sp: int) -> dict:
    """4 iterations straight vs 2 iterations, a new process state loading the checkpoint, 2 more."""
    _quiet()
    root = tempfile.mkdtemp() if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    straight = _trainer(_config(sp, False, f"{root}/a"))
    straight.config.train.iterations, straight.config.train.save_every = 4, 0
    straight.run()
    ref = {n: _full(p) for n, p in straight.engine.model.named_parameters()}

    first = _trainer(_config(sp, False, f"{root}/b"))
    first.config.train.iterations = 2
    first.run()
    torch.manual_seed(999)  # the resumed run must not depend on the process's RNG state
    second = _trainer(_config(sp, False, f"{root}/b"))
    second.config.train.iterations = 4
    second.run()
    resumed = {n: _full(p) for n, p in second.engine.model.named_parameters()}
    diff = max((ref[n] - resumed[n]).abs().max().item() for n in ref)
    moved = max((ref[n] - _full(p)).abs().max().item() for n, p in first.engine.model.named_parameters())
    return {
        "max_param_diff": diff,
        "start_iteration": second.start_iteration,
        "steps_between": moved,
        "history_len": len(second.history),
        "global_step": second.engine.global_step,
    }


def divergent_batches(rank: int, world: int) -> dict:
    """SP peers fed different latents: the debug check must raise on every rank (and nobody hangs)."""
    _quiet()
    from sp_diffusers.engine import SPDivergenceError

    config = _config(world, False)
    config.parallel.debug_checks = True
    trainer = _trainer(config)
    batch = trainer.iteration_batch(0)
    batch.latents = batch.latents + rank  # rank-dependent: a data loader keyed on the global rank
    try:
        batch.prepared(trainer.engine)
        raised = None
    except SPDivergenceError as err:
        raised = str(err)
    extra = trainer.iteration_batch(0)
    if rank == 1:
        extra.cond["reference_latents"] = extra.latents.clone()  # a key only one peer has
    try:
        extra.prepared(trainer.engine)
        extra_key = None
    except SPDivergenceError as err:
        extra_key = str(err)
    same = trainer.iteration_batch(0)
    same.prepared(trainer.engine)  # identical batches pass
    dist.barrier()
    return {"raised": raised, "extra_key": extra_key}


def features(rank: int, world: int) -> dict:
    """Activation checkpointing changes no number; LoRA + KL + CFG and bf16 mixed precision run end to end."""
    _quiet()
    out: dict = {}
    grads = {}
    for ckpt in (False, True):
        config = _config(world, False)
        config.parallel.activation_checkpointing = ckpt
        trainer = _trainer(config)
        batch, traj, adv, old = _my_batch(trainer, _global_data(trainer))
        captured = {}
        step = trainer.engine.optimizer_step

        def capture(step=step, captured=captured, trainer=trainer):
            captured.update(
                {n: _full(p.grad) for n, p in trainer.engine.model.named_parameters() if p.grad is not None}
            )
            return step()

        trainer.engine.optimizer_step = capture
        trainer.update(batch, traj, adv, old)
        grads[ckpt] = captured
    out["ckpt_max_grad_diff"] = max(
        (grads[True][n] - grads[False][n]).abs().max().item() for n in grads[False]
    )
    out["ckpt_n_grads"] = len(grads[True])

    config = _config(world, True, kl_coef=0.01, cfg_scale=2.0)
    trainer = _trainer(config)
    trainer.config.train.iterations = 2
    history = trainer.run()
    out["lora_kl_cfg"] = [
        {k: history[i][k] for k in ("kl", "loss", "reward_mean", "grad_norm")} for i in range(2)
    ]

    config = _config(world, False)
    config.parallel.mixed_precision = "bf16"
    trainer = _trainer(config)
    trainer.config.train.iterations = 2
    history = trainer.run()
    out["bf16"] = [{k: history[i][k] for k in ("loss", "reward_mean", "grad_norm")} for i in range(2)]
    out["bf16_param_dtype"] = str(next(trainer.engine.model.parameters()).dtype)
    return out


def kl_reward_collect(rank: int, world: int, sp: int) -> dict:
    """flowgrpo.kl_reward's per-step KL and advantages of one fresh rollout (random LoRA: the policy is not the
    reference), for comparison with one process."""
    _quiet()
    trainer = _trainer(
        _config(sp, True, kl_reward=0.5, prompts_per_rank=2, group_size=2, micro_batch_size=4, recompute_old_log_probs=False)
    )
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    traj, advantages, old, stats = trainer.collect(batch)
    metrics = trainer.update(batch, traj, advantages, old)
    return {"advantages": advantages.cpu(), "kl": stats["kl_to_reference"], "ratio_mean": metrics["ratio_mean"]}
