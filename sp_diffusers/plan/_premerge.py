"""WORKAROUNDS (temporary; the planner has no others), for this branch's engine and attention.

1. ``fake_safe_module_to``: the engine of this branch moves the materialised model to its
device before sharding (``model.to(self.device)`` in ``FSDPEngine.__init__``; peft's ``add_adapter`` moves each
new adapter the same way, and an unsharded bf16 engine casts with ``model.to(torch.bfloat16)``). The planner's
model is materialised as fake tensors, and torch's ``Module.to`` cannot convert a module holding fake
parameters: it swaps each parameter in place, which fake tensors refuse ("Cannot swap t1 because it has weakref
associated with it").

So while the engine is built, ``Module.to`` of a module holding fake tensors converts by replacing each
parameter and buffer that changes (a move to the device they are on changes nothing). Delete this module, and
its one use in ``plan/trace.py``, once the engine shards before weights reach the device and accepts a model on
``meta``: the planner then hands it the ``meta`` model, and every ``to`` before materialisation acts on meta
tensors, which torch converts normally.

2. ``fake_attention_agreement``: the per-call length agreement of ``ulysses_sdpa`` (see its docstring).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["fake_attention_agreement", "fake_safe_module_to"]


def _replace(module: torch.nn.Module, device: Any, dtype: Any) -> None:
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            new = p.to(device=device, dtype=dtype if dtype is not None and p.is_floating_point() else None)
            if new is not p:
                m._parameters[name] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            new = b.to(device=device, dtype=dtype if dtype is not None and b.is_floating_point() else None)
            if new is not b:
                m._buffers[name] = new


@contextlib.contextmanager
def fake_safe_module_to() -> Iterator[None]:
    """Inside this block ``Module.to`` converts a module holding fake tensors by replacement (see module doc)."""
    original = torch.nn.Module.to

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        tensors = [*self.parameters(), *self.buffers()]
        if not any(isinstance(t, FakeTensor) for t in tensors):
            return original(self, *args, **kwargs)
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        _replace(self, device, dtype)
        return self

    torch.nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


def _fit(sizes: list[int], length: int) -> list[int]:
    """Every rank's length when the ranks' lengths sum to ``length``: a rank-symmetric guess (every rank holds
    this rank's length) less one on the last ranks, as ``torch.tensor_split`` leaves them."""
    excess = sum(sizes) - length
    if 0 < excess < len(sizes):
        return [n - (i >= len(sizes) - excess) for i, n in enumerate(sizes)]
    return sizes


@contextlib.contextmanager
def fake_attention_agreement() -> Iterator[None]:
    """WORKAROUND 2 (temporary): each ``ulysses_sdpa`` call of this branch gathers every rank's lengths
    (``handshake.agree``). On the fake process group every rank is taken to hold this rank's lengths, which is
    right for even shards but one token long per trailing rank for uneven ones; a joint text+video mask then has
    the true global length and the call is refused ("fits neither local nor global lengths"). Here the lengths
    are fitted to the mask's global length. Delete this (and its use in ``plan/trace.py``) once the agreement
    is settled per forward where the plan splits the inputs (the hot-path change): the plan knows every
    rank's length there without gathering."""
    from .. import attention
    from ..handshake import CallLayout

    original = attention.agree

    def agree(query: Any, key: Any, attn_mask: Any, *args: Any) -> CallLayout:
        layout = original(query, key, attn_mask, *args)
        if attn_mask is None or attn_mask.dim() < 2:
            return layout
        q = _fit(layout.q_sizes, attn_mask.shape[-2]) if attn_mask.dim() == 4 else layout.q_sizes
        return CallLayout(q, _fit(layout.kv_sizes, attn_mask.shape[-1]), layout.mask_shapes)

    attention.agree = agree
    try:
        yield
    finally:
        attention.agree = original
