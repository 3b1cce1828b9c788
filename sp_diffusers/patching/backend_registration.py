"""Adding the ``ulysses_sdpa`` name to diffusers' attention-backend enum and registry, and removing it.

diffusers resolves every backend name through ``AttentionBackendName``, a closed ``str`` Enum:
``set_attention_backend``, the ``attention_backend()`` context manager, ``enable_parallelism``'s CP
check and ``dispatch_attention_fn``. A function registered under a plain string is stored but every
lookup then fails, so the name has to become a real enum member. Python has no public API to extend
an Enum; the member is built the way ``EnumType`` builds its own and added to the three maps it keeps.
"""

from __future__ import annotations

import logging
from typing import Any

BACKEND_NAME = "ulysses_sdpa"
_MEMBER_NAME = "ULYSSES_SDPA"

logger = logging.getLogger(__name__)


def _dispatch_module():
    from diffusers.models import attention_dispatch

    return attention_dispatch


def register_backend() -> Any:
    """Register ``ulysses_sdpa`` with diffusers (idempotent); returns the enum member."""
    from ..parallel.attention import ulysses_sdpa_attention

    mod = _dispatch_module()
    enum_cls, registry = mod.AttentionBackendName, mod._AttentionBackendRegistry
    member = enum_cls._value2member_map_.get(BACKEND_NAME)
    if member is None:
        member = str.__new__(enum_cls, BACKEND_NAME)
        member._name_ = _MEMBER_NAME
        member._value_ = BACKEND_NAME
        member.__objclass__ = enum_cls
        member._sort_order_ = len(enum_cls._member_names_)
        enum_cls._member_map_[_MEMBER_NAME] = member
        enum_cls._member_names_.append(_MEMBER_NAME)
        enum_cls._value2member_map_[BACKEND_NAME] = member
    if registry._backends.get(member) is not ulysses_sdpa_attention:
        registry.register(member, constraints=[], supports_context_parallel=True)(ulysses_sdpa_attention)
        logger.info("registered attention backend %r with diffusers", BACKEND_NAME)
    return member


def unregister_backend() -> None:
    """Remove ``ulysses_sdpa`` from diffusers (idempotent). Models still set to it need ``set_attention_backend``
    again before their next forward."""
    mod = _dispatch_module()
    enum_cls, registry = mod.AttentionBackendName, mod._AttentionBackendRegistry
    member = enum_cls._value2member_map_.get(BACKEND_NAME)
    if member is None:
        return
    if registry._active_backend is member:
        registry._active_backend = enum_cls.NATIVE
    for table in (registry._backends, registry._constraints, registry._supported_arg_names):
        table.pop(member, None)
    registry._supports_context_parallel.discard(BACKEND_NAME)
    enum_cls._member_map_.pop(_MEMBER_NAME, None)
    if _MEMBER_NAME in enum_cls._member_names_:
        enum_cls._member_names_.remove(_MEMBER_NAME)
    enum_cls._value2member_map_.pop(BACKEND_NAME, None)
