"""Wiring the per-forward scope (``sp_diffusers.parallel.agreement``) into diffusers' context parallelism.

``install()`` makes ``enable_parallelism`` attach two hooks to the model - a forward pre-hook that agrees
the inputs across the SP group (once, unless the model's mode says otherwise) and opens a
:class:`~sp_diffusers.parallel.agreement.ForwardScope`, and a post-hook that closes it and marks the outputs
for recomputed calls - and makes diffusers' split hook record every split in the open scope, named
``"<plan key>:<input>"`` (e.g. ``"context_embedder:0"``, ``"transformer_blocks.0:encoder_hidden_states"``).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.agreement import (
    ForwardScope,
    agree_forward,
    current,
    describe,
    mark_outputs,
    pop,
    push,
    rank_agreement,
)
from ..parallel.cp_groups import cp_groups
from .swaps import AttributeSwaps

__all__ = ["install", "is_installed", "split_name", "uninstall"]

_swaps = AttributeSwaps()
_tokens = itertools.count()
_HOOKS_ATTR = "_sp_diffusers_scope_hooks"
_PLAN_KEYS_ATTR = "_sp_diffusers_plan_keys"


def _parameter_names(cls: type) -> list[str]:
    names = getattr(cls, "_sp_diffusers_forward_names", None)
    if names is None or names[0] is not cls:
        names = (cls, list(inspect.signature(cls.forward).parameters)[1:])
        cls._sp_diffusers_forward_names = names
    return names[1]


@torch.compiler.assume_constant_result  # hashlib is not traceable; a compiled model has one fingerprint
def _fingerprint(model: torch.nn.Module) -> str:
    """What identifies the model across ranks: class, parameter count and numel, first dtype, config digest."""
    params = list(model.parameters())
    # diffusers' private config keys (e.g. "_use_default_values", a set turned list) vary across processes
    config = {
        k: v for k, v in dict(getattr(model, "config", None) or {}).items() if not str(k).startswith("_")
    }
    config_digest = hashlib.blake2b(repr(sorted(config.items())).encode(), digest_size=6).hexdigest()
    first = str(params[0].dtype).removeprefix("torch.") if params else None
    return (
        f"{type(model).__name__} with {len(params)} parameters ({sum(p.numel() for p in params)} values, first "
        f"{first}), config {config_digest}"
    )


def _group_device(group: Any) -> torch.device:
    """Where the agreement's small tensor lives: NCCL takes CUDA tensors only (the current device, read now);
    every other backend (gloo, fake) takes CPU tensors."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _open(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if not _swaps.active:
        return
    config = getattr(model, "_parallel_config", None)
    groups = cp_groups(config)
    if groups is None:
        return
    mode = rank_agreement(model, groups.cp_group)
    names = _parameter_names(type(model))
    named = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args)]
    inputs: list[tuple[str, str]] = []
    for name, value in sorted(named + list(kwargs.items()), key=lambda item: item[0]):
        describe(name, value, inputs)
    if mode != "trusted":
        agree_forward(
            [("the model", _fingerprint(model)), *inputs], groups.cp_group, _group_device(groups.cp_group)
        )
    scope = ForwardScope(
        config, groups.world, groups.cp_rank, mode, (getattr(model, _HOOKS_ATTR)[0], tuple(inputs))
    )
    scope.plan_keys = getattr(model, _PLAN_KEYS_ATTR, {})
    push(scope)


def _close(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    scope = current(getattr(model, "_parallel_config", None))
    if scope is None:
        return None
    pop(scope)
    # a compiled forward's recomputation (activation checkpointing) runs inside its compiled backward: no
    # attention call asks for the scope there
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return mark_outputs(scope, output)
    return None


def _enabling(original):
    def enable_parallelism(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        plan = kwargs.get("cp_plan") or getattr(self, "_cp_plan", None) or {}
        setattr(self, _PLAN_KEYS_ATTR, {id(v): k for k, v in plan.items() if isinstance(v, dict)})
        if getattr(self, _HOOKS_ATTR, None) is None:
            pre = self.register_forward_pre_hook(_open, with_kwargs=True)
            post = self.register_forward_hook(_close, with_kwargs=True, always_call=True)
            setattr(self, _HOOKS_ATTR, (next(_tokens), pre, post))
        return result

    enable_parallelism.__wrapped__ = original  # type: ignore[attr-defined]
    enable_parallelism.__doc__ = original.__doc__
    return enable_parallelism


def split_name(plan_keys: dict[int, str], metadata: dict, cp_input: Any) -> str:
    """``"<plan key>:<input>"`` of the split of ``cp_input`` (an entry of ``metadata``, one plan value)."""
    key = plan_keys.get(id(metadata), "?")
    for name, entry in metadata.items():
        if entry is cp_input:
            return f"{key}:{name}"
        if isinstance(entry, (list, tuple)):
            for i, item in enumerate(entry):
                if item is cp_input:
                    return f"{key}:{name}[{i}]"
    return f"{key}:?"


def _recording(original):
    def _prepare_cp_input(self, x, cp_input):
        expected = cp_input.expected_dims
        if expected is not None and x.dim() != expected and torch.compiler.is_compiling():
            return x  # diffusers leaves it whole, after a warning_once that dynamo cannot trace
        out = original(self, x, cp_input)
        scope = current()
        if out is not x and scope is not None:
            name = split_name(scope.plan_keys, self.metadata, cp_input)
            scope.record_split(name, x.shape[cp_input.split_dim])
        return out

    _prepare_cp_input.__wrapped__ = original  # type: ignore[attr-defined]
    return _prepare_cp_input


def install() -> None:
    """Make ``enable_parallelism`` attach the scope hooks and the split hook record splits. Idempotent."""
    if _swaps.active:
        return
    from diffusers.hooks.context_parallel import ContextParallelSplitHook
    from diffusers.models.modeling_utils import ModelMixin

    _swaps.set(ModelMixin, "enable_parallelism", _enabling(ModelMixin.enable_parallelism))
    _swaps.set(
        ContextParallelSplitHook, "_prepare_cp_input", _recording(ContextParallelSplitHook._prepare_cp_input)
    )


def uninstall() -> None:
    """Undo :func:`install`; hooks already on models stay but do nothing."""
    _swaps.restore()


def is_installed() -> bool:
    return _swaps.active
