"""verl-omni refuses ``actor_rollout_ref.model.attn_backend=ulysses_sdpa``.

Defect: verl-omni's ``DiffusionModelConfig.__post_init__`` checks ``attn_backend`` against a fixed set
written inside the method (``{"native", "_native_npu", "_flash_3_varlen_hub"}``), not against the backends
diffusers has registered, so a registered backend such as ``ulysses_sdpa`` is refused with
``ValueError: Invalid attn_backend: ulysses_sdpa`` (under hydra: an ``InstantiationException``) although its
engine hands the string straight to ``module.set_attention_backend``, which would take it. The config is
built inside verl-omni's workers from the hydra config, so no already-built object can be fixed instead.
Affected: verl-omni at ``verl-project/verl-omni`` a1139ba (and every revision with that fixed set), on every
diffusers version. Upstream: none filed; the check is ``verl_omni/workers/config/diffusion/model.py``.
Fix: ``DiffusionModelConfig.__post_init__`` runs its checks with ``attn_backend`` reading ``native`` when
it is ``ulysses_sdpa``, then puts ``ulysses_sdpa`` back; every other value meets verl-omni's check as before.
Applied only where verl-omni is installed, when its config module is imported.
"""

from __future__ import annotations

from types import ModuleType

from ..swaps import AttributeSwaps
from . import _verl_omni
from ._base import Probe, logger

NAME = "verl_omni_attn_backend"
AFFECTED = "verl-omni a1139ba, all diffusers"
UPSTREAM = "verl-omni: none filed (DiffusionModelConfig.__post_init__ valid_backends)"

MODULE = "verl_omni.workers.config.diffusion.model"
SOURCE = "workers/config/diffusion/model.py"
# what the check sees instead: in every revision's set, and (unlike the flash-attention default) it
# needs no extra package
STAND_IN = "native"

_swaps = AttributeSwaps()


def _backend() -> str:
    from ..backend_registration import BACKEND_NAME

    return BACKEND_NAME


def probe() -> Probe:
    if not _verl_omni.installed():
        return _verl_omni.NOT_INSTALLED
    src = _verl_omni.source(SOURCE)
    if src is None or "class DiffusionModelConfig" not in src:
        return Probe(False, f"verl-omni has no DiffusionModelConfig in {SOURCE}")
    if "Invalid attn_backend" not in src or f'"{_backend()}"' in src:
        return Probe(False, f"verl-omni's DiffusionModelConfig accepts attn_backend={_backend()}")
    return Probe(
        True,
        f"verl-omni's DiffusionModelConfig checks attn_backend against a fixed set without {_backend()}",
    )


def _fix(module: ModuleType) -> None:
    cls = module.DiffusionModelConfig
    original = vars(cls).get("__post_init__")
    if original is None:  # a revision without its own checks: nothing refuses the backend
        return
    backend = _backend()

    def __post_init__(self):
        wanted = getattr(self, "attn_backend", None)
        if wanted != backend:
            return original(self)
        # verl's BaseConfig freezes fields once set; verl-omni's own engine swaps this field the same way
        object.__setattr__(self, "attn_backend", STAND_IN)
        try:
            return original(self)
        finally:
            object.__setattr__(self, "attn_backend", wanted)

    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(cls, "__post_init__", __post_init__)
    logger.info("patched verl-omni DiffusionModelConfig: attn_backend=%s is accepted", backend)


_lifecycle = _verl_omni.ImportFix((MODULE,), _fix, _swaps)
apply, revert, is_applied = _lifecycle.apply, _lifecycle.revert, _lifecycle.is_applied
