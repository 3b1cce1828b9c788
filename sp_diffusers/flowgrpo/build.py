"""Building a FlowGRPO run from its ``TrainConfig``: the model, the engine settings, the text encoder, the
schedule, the step rule, and the checks that tie them together (each error names the config key and the fix)."""

from __future__ import annotations

from typing import Any

import torch

from ..engine import EngineSettings, LoraSettings, OptimSettings
from .config import ConfigError, TrainConfig
from .models.text import ByteTextEncoder, PipelineTextEncoder, UMT5TextEncoder
from .sampling.pipeline_schedule import Schedule, linspace_schedule, load_scheduler_config, pipeline_schedule
from .sampling.sde import StepRule

__all__ = [
    "ALGORITHMS",
    "build_model",
    "build_text_encoder",
    "check_algorithm",
    "check_run",
    "engine_settings",
    "run_schedule",
    "step_rule",
]

ALGORITHMS = ("flow_grpo", "dance_grpo")
_SCHEDULES = ("auto", "pipeline", "linspace")
_ENCODERS = ("", "byte", "umt5")
DANCE_KL = ("verl_omni", "flow_grpo")


def build_model(config: TrainConfig) -> torch.nn.Module:
    """The transformer of ``model.pipeline`` or ``model.pretrained`` (a ``save_pretrained`` folder of
    ``model.kind``'s class), else the tiny model.

    A pipeline's or pretrained transformer is built with its parameters on ``meta``: nothing is loaded here. The
    engine shards it first and then each rank reads only its own shards from the folder, in the training dtype
    (:func:`engine_settings` points ``weights`` there): no rank ever holds the whole model, in any dtype."""
    from ..tiny import tiny_model
    from .models.folder_checks import missing_folder
    from .models.pipeline_io import meta_transformers, transformer_folder

    c = config.model
    folder = transformer_folder(config)
    if folder is not None:
        if not folder.exists():
            raise missing_folder("model.pipeline" if c.pipeline else "model.pretrained", folder)
        return meta_transformers(config, ("transformer",))["transformer"]
    return tiny_model(c.kind, seed=c.seed, **c.overrides)


def engine_settings(
    config: TrainConfig, model: torch.nn.Module | None = None, name: str = "transformer"
) -> EngineSettings:
    """The ``parallel``, ``optim`` and ``lora`` sections as the engine's settings; for a ``model`` built on meta
    (:func:`build_model`, a pipeline's transformer ``name``), ``weights`` = its folder (each rank loads its shards
    after sharding)."""
    from ..engine.weights import on_meta
    from .models.pipeline_io import transformer_folder

    p, o, lora = config.parallel, config.optim, config.lora
    return EngineSettings(
        weights=transformer_folder(config, name) if model is not None and on_meta(model) else None,
        ulysses_sequence_parallel_size=p.ulysses_sequence_parallel_size,
        ring_degree=p.ring_degree,
        dp_replicate=p.dp_replicate,
        optim=OptimSettings(
            lr=o.lr,
            eps=o.eps,
            weight_decay=o.weight_decay,
            max_grad_norm=o.max_grad_norm,
            warmup_steps=o.warmup_steps,
        ),
        lora=LoraSettings(
            rank=lora.rank, alpha=lora.alpha, target_modules=tuple(lora.target_modules), init=lora.init
        )
        if lora.enabled
        else None,
        use_fsdp=p.use_fsdp,
        mixed_precision=p.mixed_precision or None,
        activation_checkpointing=p.activation_checkpointing,
        debug_checks=p.debug_checks,
        pad_text_to_degree=p.pad_text_to_degree,
    )


def build_text_encoder(
    config: TrainConfig, device: torch.device
) -> ByteTextEncoder | PipelineTextEncoder | UMT5TextEncoder:
    """A pipeline's own encoders for ``text.pipeline``, else the built-in ``text.encoder`` (byte / umt5)."""
    c = config.text
    if c.encoder not in _ENCODERS:
        raise ConfigError(
            f"text.encoder={c.encoder!r} is not a built-in encoder; choose 'byte', 'umt5' or '' (umt5 for wan, "
            "byte otherwise), or set text.pipeline to a pipeline folder"
        )
    pipeline = c.pipeline or config.model.pipeline
    if pipeline:
        # on the training device, in the training precision: T5-XXL alone is 4.7B parameters
        return PipelineTextEncoder(
            pipeline,
            c.max_sequence_length,
            device=device,
            dtype=torch.bfloat16 if config.parallel.mixed_precision == "bf16" else torch.float32,
        )
    if c.encoder == "umt5" or (c.encoder == "" and config.model.kind == "wan"):
        return UMT5TextEncoder(
            hidden_size=c.hidden_size,
            num_layers=c.num_layers,
            seed=c.seed,
            max_sequence_length=c.max_sequence_length,
        )
    return ByteTextEncoder(hidden_size=c.hidden_size, num_layers=c.num_layers, seed=c.seed)


def run_schedule(config: TrainConfig, adapter: Any) -> Schedule:
    """``flowgrpo.schedule``: the family's pipeline schedule (from ``flowgrpo.scheduler``, else ``text.pipeline``'s
    scheduler, else the family default), or DanceGRPO's shifted linspace (``flowgrpo.shift``)."""
    g = config.flowgrpo
    kind = g.schedule
    if kind == "auto":
        kind = "linspace" if g.algorithm == "dance_grpo" else "pipeline"
    if kind == "linspace":
        return linspace_schedule(g.num_steps, g.shift)
    folder, key = g.scheduler, "flowgrpo.scheduler"
    if not folder and config.model.pipeline:
        folder, key = config.model.pipeline, "model.pipeline"
    if not folder and config.text.pipeline:
        folder, key = config.text.pipeline, "text.pipeline"
    scheduler_config = load_scheduler_config(folder, key) if folder else None
    return pipeline_schedule(
        config.model.kind,
        g.num_steps,
        scheduler_config=scheduler_config,
        image_seq_len=adapter.tokens,
        shift=g.shift or None,
    )


def step_rule(config: TrainConfig) -> StepRule:
    """The stochastic step: DanceGRPO's for ``dance_grpo``, else flow_grpo's ``flowgrpo.sde_type``."""
    g = config.flowgrpo
    return StepRule("dance" if g.algorithm == "dance_grpo" else g.sde_type, g.noise_level)


def check_algorithm(config: TrainConfig) -> None:
    """The ``flowgrpo`` keys that choose the algorithm, its step and its schedule, each against its valid values."""
    g = config.flowgrpo
    if g.algorithm not in ALGORITHMS:
        raise ConfigError(f"flowgrpo.algorithm={g.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if g.sde_type not in ("sde", "cps"):
        raise ConfigError(
            f"flowgrpo.sde_type={g.sde_type!r}: choose 'sde' (flow_grpo's default) or 'cps' (coefficients-preserving)"
        )
    if g.algorithm == "dance_grpo" and g.sde_type != "sde":
        raise ConfigError(
            f"flowgrpo.sde_type={g.sde_type!r} is a flow_grpo step; dance_grpo takes its own (DanceGRPO's SDE); fix: "
            "remove flowgrpo.sde_type or set flowgrpo.algorithm=flow_grpo"
        )
    if g.schedule not in _SCHEDULES:
        raise ConfigError(f"flowgrpo.schedule={g.schedule!r}: choose one of {', '.join(_SCHEDULES)}")
    if not g.noise_level > 0:
        raise ConfigError(f"flowgrpo.noise_level={g.noise_level!r} must be > 0 (the SDE noise scale)")
    if g.algorithm == "flow_grpo" and g.sde_type == "cps" and not g.noise_level < 1:
        raise ConfigError(
            f"flowgrpo.noise_level={g.noise_level!r} must be < 1 with sde_type=cps (the angle a pi / 2); flow_grpo "
            "uses 0.8"
        )
    if g.dance_kl not in DANCE_KL:
        raise ConfigError(
            f"flowgrpo.dance_kl={g.dance_kl!r}: choose 'verl_omni' (KL / (eta^2 (sigma - sigma')), the Gaussian KL of "
            "the step) or 'flow_grpo' (KL / eta^2, no dt factor)"
        )
    lo, hi = g.window_range[0], g.window_range[-1]
    if (
        g.algorithm == "flow_grpo"
        and g.sde_type == "cps"
        and g.kl_coef > 0
        and hi + g.window_size - 2 >= g.num_steps - 1
    ):
        # CPS's last step (sigma' = 0) has noise std 0: the KL divides by 0 (NaN on-policy, inf after)
        raise ConfigError(
            f"flowgrpo.sde_type=cps with flowgrpo.kl_coef={g.kl_coef} and flowgrpo.window_range={g.window_range}: a window "
            f"starting at {hi - 1} reaches the last step (sigma' = 0), where CPS is deterministic (noise std 0) and the "
            f"KL term divides by 0; fix: flowgrpo.window_range=[{lo}, {g.num_steps - g.window_size}] (the window ends "
            "before the last step), or flowgrpo.kl_coef=0"
        )
    if g.algorithm == "dance_grpo" and not (0 < g.timestep_fraction <= 1):
        raise ConfigError(
            f"flowgrpo.timestep_fraction={g.timestep_fraction!r} must be in (0, 1]; DanceGRPO's scripts use 0.6"
        )
    if g.algorithm == "dance_grpo" and int((g.num_steps - 1) * g.timestep_fraction) < 1:
        raise ConfigError(
            f"flowgrpo.timestep_fraction={g.timestep_fraction} x (num_steps - 1 = {g.num_steps - 1}) trains no step; "
            "fix: raise flowgrpo.timestep_fraction or flowgrpo.num_steps"
        )


def check_run(
    config: TrainConfig, model: torch.nn.Module, text_encoder: Any, adapter: Any, sp_size: int
) -> None:
    """What only the assembled parts can tell: text width vs the model, enough tokens for the SP degree, the
    window (token counts need not divide the degree: uneven shards are exact)."""
    c, g = config, config.flowgrpo
    width_key = (
        "joint_attention_dim" if hasattr(model.config, "joint_attention_dim") else "text_dim"
    )  # Wan: text_dim
    text_dim = getattr(model.config, width_key, None)
    if text_dim is not None and text_dim != text_encoder.hidden_size:
        key = "text.pipeline" if c.text.pipeline else "text.hidden_size"
        raise ValueError(
            f"{key}: the text encoder gives {text_encoder.hidden_size}-wide embeddings but the model's "
            f"{width_key} is {text_dim}; fix: use the pipeline that matches the transformer, or set "
            f"text.hidden_size={text_dim}"
        )
    if adapter.tokens < sp_size:
        raise ValueError(
            f"model.image_size={c.model.image_size} gives {adapter.tokens} image tokens, fewer than the SP degree "
            f"{sp_size}; fix: a larger image_size, or a lower parallel.ulysses_sequence_parallel_size"
        )
    lo, hi = g.window_range
    if g.algorithm == "flow_grpo" and not (0 <= lo < hi <= g.num_steps - g.window_size + 1):
        raise ValueError(
            f"flowgrpo.window_range={g.window_range} must satisfy 0 <= lo < hi <= num_steps - window_size + 1 "
            f"= {g.num_steps - g.window_size + 1}"
        )
    if g.kl_coef > 0 and not c.lora.enabled:
        raise ValueError(
            "flowgrpo.kl_coef > 0 needs a reference policy; fix: enable lora (the reference is the base "
            "model with adapters disabled) or set flowgrpo.kl_coef=0"
        )
