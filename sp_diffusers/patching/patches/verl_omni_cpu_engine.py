"""verl-omni's engines cannot be found on a CPU (gloo) run.

Defect: verl-omni registers its FSDP engines (``diffusion_model``, ``diffusion_dpo_model``,
``diffusion_nft_model``, ``omni_model``; backends ``fsdp``/``fsdp2``) with verl's ``EngineRegistry`` for
devices ``cuda`` and ``npu`` only. Under a CPU platform (sp-diffusers' ``VERL_PLATFORM=cpu``) verl looks the
engine up under ``cpu`` and fails with ``ValueError: No engine registered for device='cpu', ...``, although
nothing on the FSDP2 path of those engines needs an accelerator: they run on gloo.
Affected: verl-omni at ``verl-project/verl-omni`` a1139ba; any verl (0.9.x) with a CPU platform.
Upstream: none filed (``@EngineRegistry.register(..., device=["cuda", "npu"])`` in
``verl_omni/workers/engine/fsdp/diffusers_impl.py`` and ``omni_impl.py``).
Fix: once those modules are imported, each of their engines registered for ``cuda`` is also registered for
``cpu``, where that key is free; verl looks ``cpu`` up only on a CPU platform, so CUDA and NPU runs are
untouched. ``VERL_ENGINE_DEVICE=cuda`` was the by-hand alternative (it redirects the lookup only).
Applied only where verl-omni is installed.
"""

from __future__ import annotations

import re
from types import ModuleType

from ..swaps import AttributeSwaps
from . import _verl_omni
from ._base import Probe, logger

NAME = "verl_omni_cpu_engine"
AFFECTED = "verl-omni a1139ba, all diffusers"
UPSTREAM = "verl-omni: none filed (EngineRegistry.register(device=['cuda', 'npu']))"

MODULES = ("verl_omni.workers.engine.fsdp.diffusers_impl", "verl_omni.workers.engine.fsdp.omni_impl")
SOURCES = ("workers/engine/fsdp/diffusers_impl.py", "workers/engine/fsdp/omni_impl.py")
FROM_DEVICE, DEVICE = "cuda", "cpu"
BACKENDS = ("fsdp", "fsdp2")

_swaps = AttributeSwaps()
_REGISTER = re.compile(r"EngineRegistry\.register\(([^)]*)\)")


def probe() -> Probe:
    if not _verl_omni.installed():
        return _verl_omni.NOT_INSTALLED
    calls = [c for rel in SOURCES for c in _REGISTER.findall(_verl_omni.source(rel) or "")]
    if not calls:
        return Probe(False, "verl-omni registers no FSDP engine in " + ", ".join(SOURCES))
    if all(f'"{DEVICE}"' in c or f"'{DEVICE}'" in c for c in calls):
        return Probe(False, "verl-omni registers its FSDP engines for the cpu device itself")
    return Probe(True, "verl-omni registers its FSDP engines for cuda/npu only: a CPU (gloo) run finds none")


def _fix(module: ModuleType) -> None:
    from verl.workers.engine.base import EngineRegistry

    added = []
    for model_type, backends in EngineRegistry._engines.items():  # no public API lists the keys
        for backend in BACKENDS:
            devices = backends.get(backend, {})
            cls = devices.get(FROM_DEVICE)
            if cls is None or cls.__module__ != module.__name__ or DEVICE in devices:
                continue  # not this module's engine, or the key is taken: verl asserts on duplicates
            _swaps.set(devices, DEVICE, cls)
            added.append(f"{model_type}/{backend}")
    if added:
        logger.info("registered verl-omni engines for device %s: %s", DEVICE, ", ".join(added))


_lifecycle = _verl_omni.ImportFix(MODULES, _fix, _swaps)
apply, revert, is_applied = _lifecycle.apply, _lifecycle.revert, _lifecycle.is_applied
