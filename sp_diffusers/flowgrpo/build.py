"""Building a FlowGRPO run from its ``TrainConfig``: the model, the engine settings, the text encoder, the
schedule, the step rule, and the checks that tie them together (each error names the config key and the fix)."""

from __future__ import annotations

from typing import Any

import torch

from ..engine import EngineSettings, LoraSettings, OptimSettings
from .algorithms.registry import algorithm_class, check_algorithm_keys
from .config import ConfigError, TrainConfig
from .models.text import ByteTextEncoder, PipelineTextEncoder, UMT5TextEncoder
from .sampling.pipeline_schedule import Schedule, linspace_schedule, load_scheduler_config, pipeline_schedule

__all__ = [
    "build_model",
    "build_text_encoder",
    "check_algorithm",
    "check_run",
    "engine_settings",
    "run_schedule",
]

_SCHEDULES = ("auto", "pipeline", "linspace")
_ENCODERS = ("", "byte", "umt5")


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
            rank=lora.rank,
            alpha=lora.alpha,
            target_modules=tuple(lora.target_modules),
            init=lora.init,
            seed=config.train.seed,
        )
        if lora.enabled
        else None,
        use_fsdp=p.use_fsdp,
        mixed_precision=p.mixed_precision or None,
        activation_checkpointing=p.activation_checkpointing,
        debug_checks=p.debug_checks,
        pad_text_to_degree=p.pad_text_to_degree,
        ema_decay=config.flowgrpo.ema_decay if config.flowgrpo.ema else None,
        ema_interval=config.flowgrpo.ema_interval,
        compile=config.train.compile,
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
        kind = algorithm_class(config).schedule_kind
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


def check_algorithm(config: TrainConfig) -> None:
    """The ``flowgrpo`` keys every algorithm reads, then the algorithm's own (``algorithms/``), each against its
    valid values."""
    g = config.flowgrpo
    if g.schedule not in _SCHEDULES:
        raise ConfigError(f"flowgrpo.schedule={g.schedule!r}: choose one of {', '.join(_SCHEDULES)}")
    if not g.noise_level > 0:
        raise ConfigError(f"flowgrpo.noise_level={g.noise_level!r} must be > 0 (the SDE noise scale)")
    check_algorithm_keys(config)


def check_run(
    config: TrainConfig, model: torch.nn.Module, text_encoder: Any, adapter: Any, sp_size: int
) -> None:
    """What only the assembled parts can tell: text width vs the model, enough tokens for the SP degree, the
    window (token counts need not divide the degree: uneven shards are exact)."""
    c, g = config, config.flowgrpo
    # the model's text width: joint_attention_dim, Wan's text_dim, Z-Image's cap_feat_dim, LTX-2's caption_channels
    keys = ("joint_attention_dim", "text_dim", "cap_feat_dim", "caption_channels")
    width_key = next((k for k in keys if hasattr(model.config, k)), "text_dim")
    text_dim = getattr(model.config, width_key, None)
    if getattr(model.config, "use_prompt_embeddings", True) is False:  # LTX-2.3: the connectors project per stream
        text_dim = None
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
    audio = adapter.audio_tokens  # LTX-2's plan splits its audio stream over the SP ranks too
    if audio and audio < sp_size:
        raise ValueError(
            f"model.frames={c.model.frames} at model.frame_rate={c.model.frame_rate:g} gives {audio} audio tokens "
            f"(model.audio_frames={c.model.audio_frames}), fewer than the SP degree {sp_size}; fix: a longer video "
            "(more model.frames) or a larger model.audio_frames, or a lower parallel.ulysses_sequence_parallel_size"
        )
    if g.kl_reward > 0 and not c.lora.enabled:
        raise ValueError(
            "flowgrpo.kl_reward > 0 needs a reference policy; fix: enable lora (the reference is the base model with "
            "adapters disabled) or set flowgrpo.kl_reward=0"
        )
    if g.kl_coef > 0 and not c.lora.enabled:
        raise ValueError(
            "flowgrpo.kl_coef > 0 needs a reference policy; fix: enable lora (the reference is the base "
            "model with adapters disabled) or set flowgrpo.kl_coef=0"
        )
