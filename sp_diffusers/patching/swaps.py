"""Reversible swaps of attributes and mapping items: what every patch applies and reverts, and the scope hooks."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

__all__ = ["AttributeSwaps"]

logger = logging.getLogger("sp_diffusers.patching")
_MISSING = object()


class AttributeSwaps:
    """Replace attributes (or mapping items) and put the originals back, newest first.

    For classes the original is read from the class's own ``__dict__``, so staticmethod/classmethod
    wrappers and inherited attributes come back exactly as they were.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any, Any, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    @staticmethod
    def _get(owner: Any, key: Any) -> Any:
        if isinstance(owner, MutableMapping):
            return owner.get(key, _MISSING)
        if isinstance(owner, type):
            return vars(owner).get(key, _MISSING)
        return getattr(owner, key, _MISSING)

    @staticmethod
    def _put(owner: Any, key: Any, value: Any) -> None:
        if isinstance(owner, MutableMapping):
            if value is _MISSING:
                owner.pop(key, None)
            else:
                owner[key] = value
        elif value is _MISSING:
            delattr(owner, key)
        else:
            setattr(owner, key, value)

    def set(self, owner: Any, key: Any, new: Any) -> None:
        self._saved.append((owner, key, self._get(owner, key), new))
        self._put(owner, key, new)

    def restore(self) -> None:
        while self._saved:
            owner, key, original, new = self._saved.pop()
            if self._get(owner, key) is not new:
                logger.warning(
                    "%r of %r was replaced again after sp_diffusers patched it; restoring it anyway",
                    key,
                    owner,
                )
            self._put(owner, key, original)
