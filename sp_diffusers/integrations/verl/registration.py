"""Registering ``SPDiffusersEngine`` with verl's ``EngineRegistry``, and building an engine through it.

Registered for backends ``fsdp`` and ``fsdp2`` (both mean FSDP2 ``fully_shard`` here) on devices cuda, npu
and cpu, under ``MODEL_TYPE`` ("sp_diffusers_diffusion") and, when no other engine holds it and verl-omni is
not installed, under verl-omni's "diffusion_model". verl asserts on a duplicate key, so registration is
idempotent and leaves keys held by another engine alone.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from verl.workers.engine.base import EngineRegistry

from ...engine import EngineSettings, FSDPEngine
from .config import BACKENDS, verl_configs
from .engine import SPDiffusersEngine

logger = logging.getLogger(__name__)

MODEL_TYPE = "sp_diffusers_diffusion"
SHARED_MODEL_TYPE = "diffusion_model"  # verl-omni's model type: taken only where nobody holds it
DEVICES = ("cuda", "npu", "cpu")
SHARED_OWNERS = ("verl_omni",)  # installed packages that register SHARED_MODEL_TYPE themselves

__all__ = ["DEVICES", "MODEL_TYPE", "SHARED_MODEL_TYPE", "fsdp_engine_via_verl", "register"]


def _holder(model_type: str, backend: str, device: str) -> type | None:
    # EngineRegistry has no public lookup by (backend, device) that ignores the current platform
    return EngineRegistry._engines.get(model_type, {}).get(backend, {}).get(device)


def _is_ours(cls: type | None) -> bool:
    # by name, not identity: a reloaded module makes a new class object for the same engine
    return cls is not None and f"{cls.__module__}.{cls.__qualname__}" == (
        f"{SPDiffusersEngine.__module__}.{SPDiffusersEngine.__qualname__}"
    )


def register() -> dict[str, list[str]]:
    """Register ``SPDiffusersEngine`` with verl's ``EngineRegistry`` (idempotent); what is registered where.

    ``MODEL_TYPE`` for every backend x device; ``SHARED_MODEL_TYPE`` only when no other engine holds any of
    its keys and no package of ``SHARED_OWNERS`` (verl-omni) is installed to claim it later (verl asserts on
    duplicate keys, and a half-shared model type would pick engines by device).
    """
    report: dict[str, list[str]] = {MODEL_TYPE: [], SHARED_MODEL_TYPE: []}
    others = {
        f"{c.__module__}.{c.__qualname__}"
        for devices in EngineRegistry._engines.get(SHARED_MODEL_TYPE, {}).values()
        for c in devices.values()
        if not _is_ours(c)
    }
    # verl-omni registers "diffusion_model" from its own plugin, maybe after us: leave the key to it
    others |= {name for name in SHARED_OWNERS if importlib.util.find_spec(name) is not None}
    targets = [MODEL_TYPE] if others else [MODEL_TYPE, SHARED_MODEL_TYPE]
    if others:
        logger.info(
            "%s is held by %s; sp-diffusers registers as %s only", SHARED_MODEL_TYPE, others, MODEL_TYPE
        )
    for model_type in targets:
        for backend in BACKENDS:
            for device in DEVICES:
                holder = _holder(model_type, backend, device)
                if holder is None:
                    EngineRegistry.register(model_type=model_type, backend=backend, device=device)(
                        SPDiffusersEngine
                    )
                elif not _is_ours(holder):
                    raise RuntimeError(
                        f"EngineRegistry[{model_type!r}][{backend!r}][{device!r}] is held by {holder.__module__}."
                        f"{holder.__qualname__}; fix: uninstall the plugin that registers it under sp-diffusers' "
                        f"model type, or set VERL_USE_EXTERNAL_PLUGINS to the plugins you want"
                    )
                report[model_type].append(f"{backend}/{device}")
    return report


def fsdp_engine_via_verl(model: torch.nn.Module, settings: EngineSettings | None = None) -> FSDPEngine:
    """``FSDPEngine(model, settings)``, built through ``EngineRegistry.new`` as verl's workers build engines.

    The settings travel as verl configs (``FSDPEngineConfig``, ``FSDPOptimizerConfig``) and come back
    unchanged, so the FSDPEngine is the one a direct call would build; the verl engine is ``.verl_engine``.
    """
    from verl.trainer.config import CheckpointConfig

    model_config, engine_config, optimizer_config = verl_configs(settings or EngineSettings(), model)
    verl_engine = EngineRegistry.new(
        model_type=MODEL_TYPE,
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    verl_engine.initialize()
    engine = verl_engine.fsdp
    engine.verl_engine = verl_engine
    return engine
