"""verl's configs -> sp-diffusers' ``EngineSettings``, and back (``fsdp_engine_via_verl``).

verl describes an engine with three objects: the model config (ours: :class:`DiffusionModelConfig`, or any
verl model config with the same field names), ``FSDPEngineConfig`` (the layout: ``strategy``,
``ulysses_sequence_parallel_size``, ``fsdp_size``, ``mixed_precision``, offload) and ``FSDPOptimizerConfig``.
This module reads them once into :class:`~sp_diffusers.engine.EngineSettings`; every setting verl has that
sp-diffusers cannot honour is refused with the verl key, the value and the fix.

``fsdp_size`` is verl's FSDP shard group: -1 (any negative, verl's default) or the world shards over every
rank; a proper divisor N of the world is HSDP with ``dp_replicate = world / N`` replica groups of N ranks, as
verl's own ``create_device_mesh`` builds its ``(ddp, fsdp)`` mesh. N must be a multiple of the SP degree (a
sequence never spans two replica groups); anything else is refused.

The CLI's verl-style hydra overrides (``sp-diffusers train actor_rollout_ref...=...``) are
``overrides.py``'s, which reads the keys defined here; nothing here imports it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...engine import EngineSettings, LoraSettings, OptimSettings
from ...parallel.mesh import MeshError, ParallelDims

__all__ = [
    "BACKENDS",
    "DiffusionModelConfig",
    "config_error",
    "dp_replicate_of",
    "engine_settings",
    "fsdp_size_of",
    "get_field",
    "model_dtype",
    "parallel_dims",
    "verl_configs",
]

BACKENDS = ("fsdp", "fsdp2")  # verl's strategies; both mean FSDP2 (fully_shard) here
SP_KEY = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
RING_KEY = "actor_rollout_ref.model.ring_degree"
FSDP_SIZE_KEY = "actor_rollout_ref.actor.fsdp_config.fsdp_size"


@dataclass
class DiffusionModelConfig:
    """The model side of the engine (verl's ``model_config``).

    One of: ``module`` (an already-built diffusers transformer), ``path`` (a ``save_pretrained`` transformer
    folder, or a pipeline folder with ``transformer/``), or ``tiny`` (an ``sp_diffusers.tiny`` kind, random
    weights: the embedded default). LoRA when ``lora_rank > 0``; ``lora["merge"]`` says what
    ``get_per_tensor_param`` sends to the rollout (see there). Other verl model configs with the same field
    names (``local_path``/``path``, ``lora_rank``, ``lora_alpha``, ``target_modules``, ...) work too.
    """

    path: str = ""
    subfolder: str | None = None  # None: "transformer" when <path>/transformer/config.json exists
    tiny: str = ""
    tiny_overrides: dict = field(default_factory=dict)
    seed: int = 0
    module: torch.nn.Module | None = field(default=None, repr=False)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = ("to_q", "to_k", "to_v", "to_out.0")
    lora_init_weights: str | bool = "gaussian"
    lora: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    attention_backend: str = "ulysses_sdpa"
    debug_checks: bool = False
    use_fsdp: bool = True
    device: str | None = None  # None: from verl's platform (cpu under VERL_PLATFORM=cpu, else cuda/npu)
    # Ulysses x Ring: verl's FSDPEngineConfig carries the Ulysses degree only (and refuses unknown keys),
    # so the ring degree rides here (actor_rollout_ref.model.ring_degree); SP degree = ulysses x ring.
    ring_degree: int = 1
    # the values of a ``module`` built on meta (EngineSettings.weights: a safetensors folder, a state dict, ...)
    weights: Any = field(default=None, repr=False)


def get_field(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` (verl dataclasses and plain objects alike); ``default`` when missing or None."""
    got = getattr(config, name, default) if config is not None else default
    return default if got is None else got


def config_error(parameter: str, got: Any, fix: str) -> ValueError:
    return ValueError(f"{parameter}={got!r} is not supported by the sp-diffusers verl engine; fix: {fix}")


def optim_settings(config: Any) -> OptimSettings:
    """verl's ``FSDPOptimizerConfig`` -> ``OptimSettings`` (AdamW, linear warmup, then constant)."""
    if config is None:
        return OptimSettings()
    name, impl = (
        str(get_field(config, "optimizer", "AdamW")),
        str(get_field(config, "optimizer_impl", "torch.optim")),
    )
    if name.lower() != "adamw" or impl != "torch.optim":
        raise config_error(
            "actor_rollout_ref.actor.optim.optimizer",
            f"{impl}.{name}",
            "optimizer=AdamW, optimizer_impl=torch.optim",
        )
    schedule = get_field(config, "lr_scheduler_type", "constant")
    if schedule != "constant":
        raise config_error(
            "actor_rollout_ref.actor.optim.lr_scheduler_type", schedule, "lr_scheduler_type=constant"
        )
    warmup = int(get_field(config, "lr_warmup_steps", -1))
    if warmup <= 0:
        total = int(get_field(config, "total_training_steps", -1))
        warmup = int(float(get_field(config, "lr_warmup_steps_ratio", 0.0)) * total) if total > 0 else 0
    override = dict(get_field(config, "override_optimizer_config", {}) or {})
    eps = float(override.pop("eps", 1e-8))
    if override:
        raise config_error(
            "actor_rollout_ref.actor.optim.override_optimizer_config",
            override,
            "only 'eps' can be overridden",
        )
    return OptimSettings(
        lr=float(config.lr),
        weight_decay=float(get_field(config, "weight_decay", 0.0)),
        betas=tuple(float(b) for b in get_field(config, "betas", (0.9, 0.999))),
        eps=eps,
        warmup_steps=warmup,
        max_grad_norm=float(get_field(config, "clip_grad", 0.0)),
    )


def mixed_precision(engine_config: Any) -> str | None:
    mp = get_field(engine_config, "mixed_precision", None)
    if not mp:
        return None
    param = str(mp.get("param_dtype", "bf16")).lower()
    reduce = str(mp.get("reduce_dtype", "fp32")).lower()
    if reduce not in ("fp32", "float32"):
        raise config_error(
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype", reduce, "reduce_dtype=fp32"
        )
    if param in ("bf16", "bfloat16"):
        return "bf16"
    if param in ("fp32", "float32"):
        return None
    raise config_error(
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", param, "param_dtype=bf16 or fp32"
    )


def model_dtype(engine_config: Any) -> torch.dtype:
    name = str(get_field(engine_config, "model_dtype", "fp32")).lower()
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if name not in table:
        raise config_error(
            "actor_rollout_ref.actor.fsdp_config.model_dtype", name, "model_dtype=fp32 (or bf16)"
        )
    return table[name]


def lora_settings(model_config: Any) -> LoraSettings | None:
    """LoRA from verl's model-config fields (``lora_rank > 0`` turns it on)."""
    rank = int(get_field(model_config, "lora_rank", 0))
    if rank <= 0:
        return None
    targets = get_field(model_config, "target_modules", LoraSettings.target_modules)
    return LoraSettings(
        rank=rank,
        alpha=float(get_field(model_config, "lora_alpha", 16.0)),
        target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
        init=get_field(model_config, "lora_init_weights", "gaussian"),
    )


def dp_replicate_of(fsdp_size: Any, world: int, sp: int = 1) -> int:
    """verl's FSDP shard group size -> HSDP's replica groups: 1 for ``fsdp_size`` < 0 or = ``world`` (shard over
    every rank), ``world / fsdp_size`` for a proper divisor of the world that is a multiple of the SP degree
    ``sp``; anything else is refused with the valid sizes."""
    valid = [n for n in range(sp, world, sp) if world % n == 0]
    if not isinstance(fsdp_size, bool) and isinstance(fsdp_size, int):
        if fsdp_size < 0 or fsdp_size == world:
            return 1
        if fsdp_size in valid:
            return world // fsdp_size
    why = (
        "is not an int"
        if isinstance(fsdp_size, bool) or not isinstance(fsdp_size, int)
        else f"exceeds the world of {world} ranks"
        if fsdp_size > world
        else f"does not divide the world of {world} ranks"
        if fsdp_size == 0 or world % fsdp_size
        else f"is not a multiple of the SP degree ulysses x ring = {sp} (an SP group would span two replica groups)"
    )
    hsdp = (
        f", or one of {valid} (HSDP: sharded within groups of fsdp_size ranks, replicated across)"
        if valid
        else ""
    )
    raise ValueError(
        f"{FSDP_SIZE_KEY}={fsdp_size!r} {why}; fix: fsdp_size=-1 (shard over all {world} ranks){hsdp}"
    )


def fsdp_size_of(dp_replicate: int, world: int) -> int:
    """The inverse of :func:`dp_replicate_of`: -1 for plain FSDP, else the replica group's ``world / dp_replicate``."""
    return -1 if dp_replicate == 1 else world // dp_replicate


def parallel_dims(model_config: Any, engine_config: Any, world: int) -> ParallelDims:
    """The layout verl's configs ask for, validated against the world (errors name the verl keys)."""
    strategy = get_field(engine_config, "strategy", "fsdp2")
    if strategy not in BACKENDS:
        raise config_error("actor_rollout_ref.actor.strategy", strategy, "strategy=fsdp2 (or fsdp)")
    ulysses = get_field(engine_config, "ulysses_sequence_parallel_size", 1)
    ring = get_field(model_config, "ring_degree", 1)
    try:
        dims = ParallelDims(world, ulysses, ring)
    except MeshError as err:
        raise MeshError(f"{SP_KEY} x {RING_KEY}: {err}") from err
    # a shard group of a multiple of sp ranks that divides the world: dp_replicate divides dp by construction
    replicate = dp_replicate_of(get_field(engine_config, "fsdp_size", -1), world, dims.sp)
    return ParallelDims(world, ulysses, ring, replicate)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def engine_settings(
    model_config: Any, engine_config: Any, optimizer_config: Any, device: Any = None, world: int | None = None
) -> EngineSettings:
    """The one translation of verl's three configs into the engine's settings (``world``: the ranks ``fsdp_size``
    is read against; None: the default process group's)."""
    return EngineSettings(
        ulysses_sequence_parallel_size=get_field(engine_config, "ulysses_sequence_parallel_size", 1),
        ring_degree=get_field(model_config, "ring_degree", 1),
        dp_replicate=parallel_dims(
            model_config, engine_config, _world() if world is None else world
        ).replicate,
        optim=optim_settings(optimizer_config),
        lora=lora_settings(model_config),
        use_fsdp=bool(get_field(model_config, "use_fsdp", True)),
        mixed_precision=mixed_precision(engine_config),
        activation_checkpointing=bool(get_field(model_config, "enable_gradient_checkpointing", False)),
        attention_backend=get_field(
            model_config, "attention_backend", DiffusionModelConfig.attention_backend
        ),
        debug_checks=bool(get_field(model_config, "debug_checks", False)),
        device=device,
        weights=get_field(model_config, "weights", None),
    )


def verl_configs(settings: EngineSettings, module: torch.nn.Module) -> tuple[Any, Any, Any]:
    """``(model_config, engine_config, optimizer_config)`` that :func:`engine_settings` reads back as
    ``settings`` (the model is passed as an object): how ``fsdp_engine_via_verl`` speaks to verl."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

    lora, o = settings.lora, settings.optim
    if lora is not None and lora.adapter_name != "default":
        raise config_error("lora.adapter_name", lora.adapter_name, "adapter_name='default'")
    world = _world()
    # the degrees checked against this world first, so a bad dp_replicate is named as the caller gave it
    ParallelDims(world, settings.ulysses_sequence_parallel_size, settings.ring_degree, settings.dp_replicate)
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        ulysses_sequence_parallel_size=settings.ulysses_sequence_parallel_size,
        fsdp_size=fsdp_size_of(settings.dp_replicate, world),
        mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32"}
        if settings.mixed_precision == "bf16"
        else None,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=o.betas,
        clip_grad=o.max_grad_norm,
        lr_warmup_steps=o.warmup_steps,
        override_optimizer_config={"eps": o.eps},
    )
    model_config = DiffusionModelConfig(
        module=module,
        lora_rank=lora.rank if lora else 0,
        lora_alpha=lora.alpha if lora else 16.0,
        target_modules=lora.target_modules if lora else DiffusionModelConfig.target_modules,
        lora_init_weights=lora.init if lora else "gaussian",
        enable_gradient_checkpointing=settings.activation_checkpointing,
        attention_backend=settings.attention_backend,
        debug_checks=settings.debug_checks,
        use_fsdp=settings.use_fsdp,
        device=str(settings.device) if settings.device is not None else None,
        ring_degree=settings.ring_degree,
        weights=settings.weights,
    )
    return model_config, engine_config, optimizer_config
