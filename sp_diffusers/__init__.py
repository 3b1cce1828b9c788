"""sp-diffusers: exact Ulysses sequence parallelism for diffusers transformers, for RL training.

    import sp_diffusers
    print(sp_diffusers.install())            # registers "ulysses_sdpa", applies the patches diffusers needs
    model.set_attention_backend("ulysses_sdpa")
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=2))

Importing this package changes nothing in diffusers or torch; ``install()`` does, ``uninstall()`` undoes it.
"""

from __future__ import annotations

from typing import Any

from .patching.backend_registration import BACKEND_NAME

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "EngineSettings",
    "FSDPEngine",
    "InstallReport",
    "LoraSettings",
    "OptimSettings",
    "__version__",
    "build_device_mesh",
    "context_parallel_config",
    "install",
    "pad_text_batch",
    "set_rank_agreement",
    "sp_degree",
    "sync_sp_gradients",
    "uninstall",
]

_LAZY = {
    "install": ("patching.installer", "install"),
    "uninstall": ("patching.installer", "uninstall"),
    "is_installed": ("patching.installer", "is_installed"),
    "InstallReport": ("patching.installer", "InstallReport"),
    "context_parallel_config": ("patching.cp_config", "context_parallel_config"),
    "build_device_mesh": ("parallel.mesh", "build_device_mesh"),
    "FSDPEngine": ("engine", "FSDPEngine"),
    "EngineSettings": ("engine", "EngineSettings"),
    "LoraSettings": ("engine", "LoraSettings"),
    "OptimSettings": ("engine", "OptimSettings"),
    "pad_text_batch": ("parallel.padding", "pad_text_batch"),
    "sync_sp_gradients": ("parallel.gradients", "sync_sp_gradients"),
    "sp_degree": ("parallel.gradients", "sp_degree"),
    "set_rank_agreement": ("parallel.agreement", "set_rank_agreement"),
    "ulysses_sdpa_attention": ("parallel.attention", "ulysses_sdpa_attention"),
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import sp_diffusers` stays cheap and side-effect free (no diffusers import).
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
