"""A context-parallel plan input that the call leaves at its default makes diffusers' split hook raise.

Defect: ``ContextParallelSplitHook.pre_forward`` looks every input its plan names up in the call's arguments
(``ModuleForwardMetadata._get_parameter_from_args_kwargs``); one passed neither by keyword nor by position
raises ``ValueError: Expected <i> arguments but got <n>`` - even an optional input whose default is ``None``,
which the hook skips when it is passed explicitly as ``None``. Shipped plans name optional inputs: 0.36's
Qwen-Image plan splits ``encoder_hidden_states_mask`` at the root, so a Qwen-Image call without a text mask
fails under context parallelism (and works without it); and a plan cannot name an input that only some calls
pass - the fixed LTX-2 plan (``ltx2_plan``) names both text masks, ``audio_timestep`` and
``video_keyframes_mask``, all optional.
Affected: every release with context parallelism, 0.36-0.42. Upstream: none filed
(hooks/context_parallel.py ``ModuleForwardMetadata``).
Fix: a named input that is not passed and whose parameter defaults to ``None`` is reported as ``None`` (the
value the call runs with), so the hook skips it as it skips an explicit ``None``; everything else (a required
input missing, a name not in the signature) still raises diffusers' own error.
"""

from __future__ import annotations

import inspect

import torch

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "plan_optional_inputs"
AFFECTED = "0.36-0.42"
UPSTREAM = "none filed (hooks/context_parallel.py ModuleForwardMetadata._get_parameter_from_args_kwargs)"

_swaps = AttributeSwaps()


def _metadata_cls():
    from diffusers.hooks.context_parallel import ModuleForwardMetadata

    return ModuleForwardMetadata


class _Probe:
    def forward(self, hidden_states, mask=None):  # the shape of an optional plan input
        return hidden_states


def probe() -> Probe:
    metadata = _metadata_cls()(_cls=_Probe)
    try:
        metadata._get_parameter_from_args_kwargs("mask", (object(),), {})
    except ValueError as err:
        return Probe(True, f"a plan input left at its default None raises: {err}")
    return Probe(False, "plan inputs left at their default are skipped")


@torch.compiler.assume_constant_result  # inspect.signature is not traceable: a compiled hook reads the answer
def _optional_index(cls: type, identifier: str) -> int | None:
    """Position of ``identifier`` among ``cls.forward``'s arguments (without self) if it defaults to None."""
    if (cls, identifier) not in _OPTIONAL_INDEX:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        found = (i for i, p in enumerate(params) if p.name == identifier and p.default is None)
        _OPTIONAL_INDEX[(cls, identifier)] = next(found, None)
    return _OPTIONAL_INDEX[(cls, identifier)]


_OPTIONAL_INDEX: dict[tuple[type, str], int | None] = {}


def apply() -> None:
    if _swaps.active:
        return
    cls = _metadata_cls()
    original = cls._get_parameter_from_args_kwargs

    def _get_parameter_from_args_kwargs(self, identifier: str, args=(), kwargs=None):
        kwargs = kwargs or {}
        if identifier not in kwargs and self._cls is not None:
            index = _optional_index(self._cls, identifier)
            if index is not None and index >= len(args):
                return None, False, None  # not passed: the call runs with None, which the hook skips
        return original(self, identifier, args, kwargs)

    _get_parameter_from_args_kwargs.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(cls, "_get_parameter_from_args_kwargs", _get_parameter_from_args_kwargs)
    logger.info("patched ModuleForwardMetadata: plan inputs left at their default None are skipped")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
