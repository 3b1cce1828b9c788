"""Building a FlowGRPO run from its ``TrainConfig``: the model, the engine settings, the text encoder, the
schedule, and the checks that tie them together (each error names the config key and the fix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..engine import EngineSettings, LoraSettings, OptimSettings
from .config import TrainConfig
from .schedule import flow_sigmas
from .text import ByteTextEncoder, PipelineTextEncoder

__all__ = ["build_model", "build_text_encoder", "check_run", "engine_settings", "run_sigmas"]


def build_model(config: TrainConfig) -> torch.nn.Module:
    """``model.pretrained`` (a ``save_pretrained`` folder of ``model.kind``'s class), else the tiny model."""
    from ..model_kinds import model_class
    from ..tiny import tiny_model

    c = config.model
    if c.pretrained:
        if not Path(c.pretrained).exists():
            raise FileNotFoundError(
                f"model.pretrained={c.pretrained!r} does not exist (a save_pretrained folder)"
            )
        return model_class(c.kind).from_pretrained(c.pretrained)
    return tiny_model(c.kind, seed=c.seed, **c.overrides)


def engine_settings(config: TrainConfig) -> EngineSettings:
    """The ``parallel``, ``optim`` and ``lora`` sections as the engine's settings."""
    p, o, lora = config.parallel, config.optim, config.lora
    return EngineSettings(
        ulysses_sequence_parallel_size=p.ulysses_sequence_parallel_size,
        ring_degree=p.ring_degree,
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


def build_text_encoder(config: TrainConfig, device: torch.device) -> ByteTextEncoder | PipelineTextEncoder:
    """A pipeline's own encoders for ``text.pipeline``, else the built-in byte-level encoder."""
    c = config.text
    if c.pipeline:
        # on the training device, in the training precision: T5-XXL alone is 4.7B parameters
        return PipelineTextEncoder(
            c.pipeline,
            c.max_sequence_length,
            device=device,
            dtype=torch.bfloat16 if config.parallel.mixed_precision == "bf16" else torch.float32,
        )
    return ByteTextEncoder(hidden_size=c.hidden_size, num_layers=c.num_layers, seed=c.seed)


def run_sigmas(config: TrainConfig) -> torch.Tensor:
    g = config.flowgrpo
    return flow_sigmas(g.num_steps, shift=g.shift or None)


def check_run(
    config: TrainConfig, model: torch.nn.Module, text_encoder: Any, adapter: Any, sp_size: int
) -> None:
    """What only the assembled parts can tell: text width vs the model, enough tokens for the SP degree, the
    window (token counts need not divide the degree: uneven shards are exact)."""
    c, g = config, config.flowgrpo
    text_dim = getattr(model.config, "joint_attention_dim", None)
    if text_dim is not None and text_dim != text_encoder.hidden_size:
        key = "text.pipeline" if c.text.pipeline else "text.hidden_size"
        raise ValueError(
            f"{key}: the text encoder gives {text_encoder.hidden_size}-wide embeddings but the model's "
            f"joint_attention_dim is {text_dim}; fix: use the pipeline that matches the transformer, or set "
            f"text.hidden_size={text_dim}"
        )
    if adapter.tokens < sp_size:
        raise ValueError(
            f"model.image_size={c.model.image_size} gives {adapter.tokens} image tokens, fewer than the SP degree "
            f"{sp_size}; fix: a larger image_size, or a lower parallel.ulysses_sequence_parallel_size"
        )
    lo, hi = g.window_range
    if not (0 <= lo < hi <= g.num_steps - g.window_size + 1):
        raise ValueError(
            f"flowgrpo.window_range={g.window_range} must satisfy 0 <= lo < hi <= num_steps - window_size + 1 "
            f"= {g.num_steps - g.window_size + 1}"
        )
    if g.kl_coef > 0 and not c.lora.enabled:
        raise ValueError(
            "flowgrpo.kl_coef > 0 needs a reference policy; fix: enable lora (the reference is the base "
            "model with adapters disabled) or set flowgrpo.kl_coef=0"
        )
