"""The RL iteration on real gloo ranks: rollouts (and the old log-probs they recompute) with weights gathered once
against per-step gathers, classifier-free guidance in one forward against two, and one iteration's communication
ledger as the number of steps and CFG change. Each function returns plain data; the parent asserts."""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from tests.workers.engine_steps import _config, _quiet, _trainer


def _kind_config(sp: int, kind: str, **flowgrpo):
    c = _config(sp, False, kind=kind, **flowgrpo)
    if kind == "wan":
        c.model.frames, c.text.max_sequence_length, c.flowgrpo.reward = 2, 16, "video_color"
    if kind == "flux":  # the built-in text encoder gives no pooled CLIP input: the masked mean stands in (32 wide)
        c.model.overrides["pooled_projection_dim"] = 32
        c.text.max_sequence_length = 16
    return c


def _collect(trainer, batch, gather: bool, cfg_batch: bool) -> dict:
    trainer._gather_once, trainer.config.rollout.cfg_batch = gather, cfg_batch
    traj, adv, old, stats = trainer.collect(dataclasses.replace(batch))
    return {
        "final": traj.final.cpu(),
        "log_probs": traj.log_probs.cpu(),
        "old": old.cpu(),
        "advantages": adv.cpu(),
        "reward_mean": stats["reward_mean"],
    }


def _branch_diffs(trainer, batch) -> dict[str, float]:
    """Each branch's raw velocity at the first step: its own forward against its half of the batched forward."""
    from sp_diffusers.flowgrpo.sampling.guidance import paired

    engine, adapter = trainer.engine, trainer.adapter
    cond = batch.cond
    x, t = batch.latents.float(), trainer.schedule.timesteps[0]
    names = ("prompt_embeds", "prompt_embeds_mask", "pooled_prompt_embeds")

    def forward(x, text, prefix=""):
        embeds, mask, pooled = (text.get(prefix + n) for n in names)
        return engine.forward(**adapter.inputs(x, t, embeds, mask, pooled)).float()

    with engine.eval_mode():
        v_cond, v_uncond = forward(x, cond), forward(x, cond, "negative_")
        both_cond, both_uncond = forward(torch.cat([x, x]), paired(cond)).chunk(2)
    return {
        "cond": (both_cond - v_cond).abs().max().item(),
        "uncond": (both_uncond - v_uncond).abs().max().item(),
        "scale": max(v_cond.abs().max().item(), v_uncond.abs().max().item()),
    }


def rollout_modes(rank: int, world: int, sp: int, kinds: list[str]) -> dict:
    """Per family, one prepared batch with CFG (scale 4) collected four ways: {per-step, once} x {two forwards,
    one}; the differences to the per-step, two-forward collection (today's), and which lengths the texts had."""
    _quiet()
    out: dict = {}
    for kind in kinds:
        trainer = _trainer(_kind_config(sp, kind, cfg_scale=4.0))
        batch = trainer.iteration_batch(0).prepared(trainer.engine)
        ref = _collect(trainer, batch, gather=False, cfg_batch=False)
        diffs = {}
        for gather in (False, True):
            for cfg_batch in (False, True):
                got = _collect(trainer, batch, gather, cfg_batch)
                diffs[f"gather={gather},cfg_batch={cfg_batch}"] = {
                    k: (got[k] - ref[k]).abs().max().item() if torch.is_tensor(ref[k]) else abs(got[k] - ref[k])
                    for k in ref
                }
        out[kind] = {
            "diffs": diffs,
            "branches": _branch_diffs(trainer, batch),
            "text_lengths": (batch.cond["prompt_embeds"].shape[1], batch.cond["negative_prompt_embeds"].shape[1]),
            "ragged": len({int(m.sum()) for m in batch.cond["prompt_embeds_mask"]}) > 1,
        }
    return out


def iteration_ledgers(rank: int, world: int, sp: int, kind: str, runs: dict[str, dict]) -> dict:
    """One training iteration per run (``{name: {flowgrpo key: value, section: {key: value}}}``, sections
    ``rollout``, ``parallel``, ``update``): this rank's ledger (``(phase, kind) -> (calls, bytes)``, as strings)
    and the reward, for the same first batch."""
    from sp_diffusers.parallel.ledger import CommLedger

    _quiet()
    out: dict = {}
    for name, settings in runs.items():
        settings = dict(settings)
        sections = {section: settings.pop(section, {}) for section in ("rollout", "parallel", "update")}
        config = _kind_config(sp, kind, drop_zero_advantage=False, **settings)
        for section, values in sections.items():
            for key, value in values.items():
                setattr(getattr(config, section), key, value)
        trainer = _trainer(config)
        ledger = CommLedger()
        with ledger.recording():
            metrics = trainer.train_iteration(0)
            first = ledger.take()
            # again on the same batch: the steady state, where an uneven text length's layouts are known (the first
            # forward with a new length learns them once: a few small gathers, ``parallel/agreement.py``)
            trainer.train_iteration(0)
        batch = trainer.iteration_batch(0).prepared(trainer.engine)
        text = [batch.cond[k].shape[1] for k in ("prompt_embeds", "negative_prompt_embeds") if k in batch.cond]
        out[name] = {
            "ledger": {f"{p}/{k}": v for (p, k), v in first.items()},
            "steady": {f"{p}/{k}": v for (p, k), v in ledger.take().items()},
            "reward_mean": metrics["reward_mean"],
            "gathered_once": trainer._gather_once,
            "text_len": max(text),  # what the model sees (CFG: both branches padded to the longer)
            "layers": trainer.engine.model.config.num_layers,
        }
    return out


def frozen_expert(rank: int, world: int, folder: str) -> dict:
    """Wan2.2 with only its low-noise expert trained (``model.experts: [transformer_2]``) at ``world`` ranks (SP =
    world): the frozen high-noise expert's bytes on this rank against its whole size, and one rollout's final latents
    (the frozen expert runs its steps sharded, gathered once)."""
    from sp_diffusers.flowgrpo.config import TrainConfig

    _quiet()
    c = TrainConfig()
    c.model.pipeline, c.model.frames, c.model.image_size, c.model.experts = folder, 2, 8, ["transformer_2"]
    c.text.max_sequence_length = 16
    c.parallel.ulysses_sequence_parallel_size = world
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 6, 1, [5, 6]
    c.flowgrpo.recompute_old_log_probs, c.flowgrpo.reward = False, "video_color"
    c.train.out_dir, c.train.progress, c.train.plot = tempfile.mkdtemp(), False, False
    trainer = _trainer(c)
    frozen = trainer.engine.experts["transformer"]

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    traj, *_ = trainer.collect(batch)
    return {
        "unsharded": [n for n, p in frozen.model.named_parameters() if not hasattr(p, "to_local")][:10],
        "frozen": frozen.settings.frozen,
        "optimizer": frozen.optimizer is not None,
        "grads": any(p.requires_grad for p in frozen.model.parameters()),
        "rank_bytes": sum(local(p).numel() * local(p).element_size() for p in frozen.model.parameters()),
        "full_bytes": sum(p.numel() * p.element_size() for p in frozen.model.parameters()),
        # FSDP2's rows of each parameter for this rank: torch.chunk of dim 0 over the ranks
        "chunk_bytes": sum(
            (len(torch.empty(p.shape[0]).chunk(world)) > rank and torch.empty(p.shape[0]).chunk(world)[rank].numel())
            * (p.numel() // max(1, p.shape[0]))
            * p.element_size()
            for p in frozen.model.parameters()
        ),
        "route": list(trainer.engine.route),
        "final": traj.final.cpu(),
    }


def update_modes(rank: int, world: int, sp: int, lora: bool) -> dict:
    """One policy update (2 micro-batches x 2 trained steps, one optimizer step) on the same data twice: per-block
    gathers and weights held over the micro-steps (``update.gather_params``): the parameters after the step and
    each update's ledger."""
    from sp_diffusers.parallel.ledger import CommLedger
    from tests.workers.engine_steps import _full, _global_data, _my_batch

    _quiet()
    out: dict = {}
    for hold in (False, True):
        config = _config(sp, lora)
        config.update.gather_params = "always" if hold else "never"
        trainer = _trainer(config)
        batch, traj, adv, old = _my_batch(trainer, _global_data(trainer))
        ledger = CommLedger()
        with ledger.recording():
            metrics = trainer.update(batch, traj, adv, old)
        out[hold] = {
            "params": {n: _full(p) for n, p in trainer.engine.model.named_parameters() if p.requires_grad},
            "ledger": {f"{p}/{k}": v for (p, k), v in ledger.take().items()},
            "loss": metrics["loss"],
            "held": trainer._update_gather,
        }
    return out


def ema_run(rank: int, world: int, out_dir: str) -> dict:
    """Two iterations with flowgrpo.ema (updated every optimizer step), saved; then a new trainer resuming from that
    checkpoint. Returns the averages and the parameters (full tensors) of both."""
    from tests.workers.engine_steps import _full

    _quiet()

    def config():
        c = _config(world, False, out_dir)
        c.flowgrpo.ema, c.flowgrpo.ema_interval = True, 1
        c.train.iterations, c.train.save_every = 2, 0
        c.optim.lr = 1e-2  # steps that move the parameters well past fp32 rounding
        return c

    def state(trainer):
        ema = trainer.engine.ema
        return {
            "averages": {n: _full(t) for n, t in ema.averages.items()},
            "params": {n: _full(p) for n, p in trainer.engine.model.named_parameters() if p.requires_grad},
            "step": trainer.engine.global_step,
        }

    first = _trainer(config())
    first.run()
    resumed = _trainer(config())
    resumed.run()  # nothing left to train: it loads the checkpoint and stops
    return {"first": state(first), "resumed": state(resumed)}


def conditioned_ledgers(rank: int, world: int, sp: int, folder: str, rows: str, runs: dict[str, dict]) -> dict:
    """``iteration_ledgers`` for an edit family: a real QwenImageEditPipeline folder (written by the parent), rows
    with a source image each, the condition image at the output's size (its tokens after the noisy ones)."""
    from sp_diffusers.parallel.ledger import CommLedger

    _quiet()
    out: dict = {}
    for name, settings in runs.items():
        c = _config(sp, False, **settings)
        c.model.kind, c.model.pipeline, c.model.overrides = "", folder, {}
        c.model.condition_area = 64 * 64  # the output's 64 x 64 pixels (latent 8 x 8, the tiny VAE's 8x)
        c.data.train, c.flowgrpo.drop_zero_advantage = rows, False
        trainer = _trainer(c)
        ledger = CommLedger()
        with ledger.recording():
            trainer.train_iteration(0)
            ledger.take()
            trainer.train_iteration(0)  # the steady state (a new text length's layouts are learned once)
        batch = trainer.iteration_batch(0).prepared(trainer.engine)
        text = [batch.cond[k].shape[1] for k in ("prompt_embeds", "negative_prompt_embeds") if k in batch.cond]
        out[name] = {
            "steady": {f"{p}/{k}": v for (p, k), v in ledger.take().items()},
            "text_len": max(text),
            "condition_tokens": batch.cond["condition_latents"].shape[1],
            "noisy_tokens": trainer.adapter.tokens,
        }
    return out
