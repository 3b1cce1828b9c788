"""verl-omni refuses Ulysses sequence parallelism on diffusers 0.36/0.37.

Defect: verl-omni's FSDP engine (``DiffusersFSDPEngine._init_device_mesh``) raises ``RuntimeError: Ulysses
sequence parallelism requires diffusers >= 0.38.0`` whenever ``ulysses_sequence_parallel_size > 1`` on an
older diffusers, because it passes ``ContextParallelConfig(ulysses_degree=sp, mesh=<(dp, ring, ulysses)
mesh>)``, and ``mesh=`` first exists in 0.38. With sp-diffusers installed, 0.36/0.37 take that call as
0.38 does (the ``mesh_injection`` patch), so the refusal blocks a configuration that works.
Affected: verl-omni at ``verl-project/verl-omni`` a1139ba, on diffusers 0.36.x and 0.37.x.
Upstream: none filed (the version check in ``verl_omni/workers/engine/fsdp/diffusers_impl.py``).
Fix: while ``_init_device_mesh`` runs with SP > 1 and ``mesh_injection`` is applied, ``diffusers.__version__``
reads ``0.38.0`` (verl-omni reads it nowhere else in that method); the method itself is verl-omni's own,
unchanged. Without ``mesh_injection`` the refusal stands. Applied only where verl-omni is installed.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

from ..swaps import AttributeSwaps
from . import _verl_omni, mesh_injection
from ._base import Probe, logger

NAME = "verl_omni_min_diffusers"
AFFECTED = "verl-omni a1139ba, diffusers 0.36-0.37"
UPSTREAM = "verl-omni: none filed (_init_device_mesh refuses diffusers < 0.38.0)"

MODULE = "verl_omni.workers.engine.fsdp.diffusers_impl"
SOURCE = "workers/engine/fsdp/diffusers_impl.py"
METHOD = "_init_device_mesh"
FLOOR = "0.38.0"  # the version verl-omni asks for

_swaps = AttributeSwaps()


def probe() -> Probe:
    if not _verl_omni.installed():
        return _verl_omni.NOT_INSTALLED
    from ..compat import config_accepts_mesh

    if config_accepts_mesh():
        return Probe(False, f"diffusers takes ContextParallelConfig(mesh=...): verl-omni's >= {FLOOR} holds")
    src = _verl_omni.source(SOURCE) or ""
    if f"def {METHOD}" not in src or f'"{FLOOR}"' not in src:
        return Probe(False, f"verl-omni's engine has no diffusers >= {FLOOR} refusal in {SOURCE}")
    return Probe(
        True, f"verl-omni refuses Ulysses SP below diffusers {FLOOR}; mesh_injection gives mesh= here"
    )


@contextlib.contextmanager
def _diffusers_reads_floor():
    import diffusers

    from ..compat import diffusers_version

    diffusers_version()  # cached before the swap: sp-diffusers' own version facts stay true
    real = diffusers.__version__
    diffusers.__version__ = FLOOR
    try:
        yield
    finally:
        diffusers.__version__ = real


def _fix(module: ModuleType) -> None:
    for cls in vars(module).values():
        original = vars(cls).get(METHOD) if isinstance(cls, type) else None
        if original is None or getattr(cls, "__module__", None) != module.__name__:
            continue

        def _init_device_mesh(self, _original=original):
            sp = getattr(getattr(self, "engine_config", None), "ulysses_sequence_parallel_size", 1) or 1
            if sp > 1 and mesh_injection.is_applied():
                with _diffusers_reads_floor():
                    return _original(self)
            return _original(self)

        _init_device_mesh.__wrapped__ = original  # type: ignore[attr-defined]
        _swaps.set(cls, METHOD, _init_device_mesh)
        logger.info(
            "patched verl-omni %s.%s: Ulysses SP allowed below diffusers %s", cls.__name__, METHOD, FLOOR
        )


_lifecycle = _verl_omni.ImportFix((MODULE,), _fix, _swaps)
apply, revert, is_applied = _lifecycle.apply, _lifecycle.revert, _lifecycle.is_applied
