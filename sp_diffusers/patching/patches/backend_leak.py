"""``model.set_attention_backend(name)`` also changes the process-wide default backend.

Defect: from 0.37, ``ModelMixin.set_attention_backend`` ends with
``_AttentionBackendRegistry.set_active_backend(backend)``: setting one model's backend silently switches
every other model in the process whose processors use the default (a reference model, a VAE, a second
transformer in the same test or trainer).
Affected: diffusers 0.37-0.42. Upstream: no issue filed as of 2026-11.
Fix: ``set_attention_backend`` remembers the process-wide default and restores it on return; the model's
own processors keep the backend they were given.
"""

from __future__ import annotations

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "backend_leak"
AFFECTED = "0.37-0.42"
UPSTREAM = "none filed (ModelMixin.set_attention_backend calls set_active_backend)"

_swaps = AttributeSwaps()


def _registry():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return AttentionBackendName, _AttentionBackendRegistry


def probe() -> Probe:
    import logging as _logging

    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.utils import logging as dlogging

    names, registry = _registry()

    class _Empty(ModelMixin):
        pass

    before = registry._active_backend
    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity(_logging.ERROR)
    try:
        registry._active_backend = names.NATIVE
        _Empty().set_attention_backend(names._NATIVE_MATH.value)
        leaked = registry._active_backend is not names.NATIVE
    finally:
        registry._active_backend = before
        dlogging.set_verbosity(verbosity)
    if leaked:
        return Probe(True, "set_attention_backend on one model changed the process-wide default backend")
    return Probe(False, "set_attention_backend leaves the process-wide default alone")


def apply() -> None:
    if _swaps.active:
        return
    from diffusers.models.modeling_utils import ModelMixin

    _, registry = _registry()
    original = ModelMixin.set_attention_backend

    def set_attention_backend(self, backend: str) -> None:
        previous = registry._active_backend
        try:
            return original(self, backend)
        finally:
            registry._active_backend = previous

    set_attention_backend.__wrapped__ = original  # type: ignore[attr-defined]
    set_attention_backend.__doc__ = original.__doc__
    _swaps.set(ModelMixin, "set_attention_backend", set_attention_backend)
    logger.info("patched ModelMixin.set_attention_backend: the process-wide default backend is left alone")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
