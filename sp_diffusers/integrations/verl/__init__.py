"""sp-diffusers in verl: an engine for ``actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size``.

Importing this package imports nothing of verl (the CLI reads verl-style keys through ``overrides`` without it).
The ``verl.plugins`` entry point is :mod:`.plugin`: ``import verl`` imports it, which registers
``SPDiffusersEngine`` with verl's ``EngineRegistry`` and runs ``sp_diffusers.install()``; so does reading any of
the names below from this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "BACKENDS",
    "DEVICES",
    "INPUT_NAMES",
    "MODEL_TYPE",
    "SHARED_MODEL_TYPE",
    "DiffusionModelConfig",
    "SPDiffusersEngine",
    "engine_loss",
    "fsdp_engine_via_verl",
    "register",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.plugin"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
