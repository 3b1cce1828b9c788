"""Values that type-check but cannot train: each refused with the key, the value and the rule (``validate``)."""

from __future__ import annotations

import math
from typing import Any

from .config_schema import GATHER_MODES, LOGGERS, TINY_KIND, ConfigError, TrainConfig

__all__ = ["validate"]


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}")


def validate(config: TrainConfig) -> None:
    """Values that type-check but cannot train (each error names the key, the value and the rule)."""
    from ..families.kinds import KINDS

    g, o, t = config.flowgrpo, config.optim, config.train
    finite = math.isfinite
    m = config.model
    _require(
        m.kind in KINDS or m.kind == "",
        "model.kind",
        m.kind,
        f"one of {', '.join(KINDS)}, or leave it out to take it from model.pipeline / model.pretrained",
    )
    if not (m.kind or m.pipeline or m.pretrained):
        m.kind = TINY_KIND  # no folder to take the family from: the tiny default (a folder's is read at start)
    _require(t.iterations >= 1, "train.iterations", t.iterations, "train at least 1 iteration")
    _require(
        t.save_every >= 0, "train.save_every", t.save_every, "0 (only at the end) or a positive interval"
    )
    for key, value in (
        ("parallel.dp_replicate", config.parallel.dp_replicate),
        ("flowgrpo.micro_batch_size", g.micro_batch_size),
        ("flowgrpo.mini_batches", g.mini_batches),
        ("flowgrpo.inner_epochs", g.inner_epochs),
        ("flowgrpo.prompts_per_rank", g.prompts_per_rank),
        ("flowgrpo.window_size", g.window_size),
    ):
        _require(value >= 1, key, value, "must be >= 1")
    _require(
        g.group_size >= 2,
        "flowgrpo.group_size",
        g.group_size,
        "must be >= 2: a group of one sample has no relative advantage (every advantage is 0)",
    )
    _require(g.num_steps >= 2, "flowgrpo.num_steps", g.num_steps, "must be >= 2 denoising steps")
    _require(
        g.window_size <= g.num_steps,
        "flowgrpo.window_size",
        g.window_size,
        f"must be <= flowgrpo.num_steps={g.num_steps}",
    )
    # lr = 0 is allowed: a benchmark or a probe may run the update without moving the model
    _require(finite(o.lr) and o.lr >= 0, "optim.lr", o.lr, "must be a finite number >= 0")
    for key, value in (
        ("optim.eps", o.eps),
        ("flowgrpo.noise_level", g.noise_level),
        ("flowgrpo.clip_range", g.clip_range),
    ):
        _require(finite(value) and value > 0, key, value, "must be a finite number > 0")
    for key, value in (
        ("optim.weight_decay", o.weight_decay),
        ("flowgrpo.kl_coef", g.kl_coef),
        ("flowgrpo.adv_clip_max", g.adv_clip_max),
    ):
        _require(finite(value) and value >= 0, key, value, "must be a finite number >= 0")
    # NaN compares false with everything: a NaN max norm would silently turn clipping off
    _require(
        finite(o.max_grad_norm), "optim.max_grad_norm", o.max_grad_norm, "a finite number (<= 0: no clipping)"
    )
    _require(
        finite(g.cfg_scale) and g.cfg_scale >= 1.0,
        "flowgrpo.cfg_scale",
        g.cfg_scale,
        "must be >= 1 (1: no CFG)",
    )
    _require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _require(0 <= g.ema_decay < 1, "flowgrpo.ema_decay", g.ema_decay, "must be in [0, 1); flow_grpo uses 0.9")
    _require(g.ema_interval >= 1, "flowgrpo.ema_interval", g.ema_interval, "must be >= 1; flow_grpo uses 8")
    for key, value in (
        ("rollout.gather_params", config.rollout.gather_params),
        ("update.gather_params", config.update.gather_params),
    ):
        _require(value in GATHER_MODES, key, value, f"one of {', '.join(GATHER_MODES)}")
    for key, value in (("train.eval_every", t.eval_every), ("train.sample_every", t.sample_every)):
        _require(value >= 0, key, value, "0 (never) or a positive interval in iterations")
    _require(t.sample_count >= 1, "train.sample_count", t.sample_count, "must be >= 1")
    unknown = [x for x in t.loggers if x not in LOGGERS]
    _require(not unknown, "train.loggers", t.loggers, f"each one of {', '.join(LOGGERS)} (unknown: {unknown})")
    if "wandb" in t.loggers:
        import importlib.util

        _require(
            importlib.util.find_spec("wandb") is not None,
            "train.loggers",
            t.loggers,
            "wandb is not installed; fix: pip install 'sp-diffusers[wandb]' (or drop wandb from train.loggers)",
        )
    _require(
        not t.eval_every or bool(config.data.eval),
        "train.eval_every",
        t.eval_every,
        "evaluates the held-out prompts of data.eval; fix: data.eval=<a .txt or .jsonl file>, or train.eval_every=0",
    )
