"""``Module.to`` for a model whose parameters are fake tensors.

The planner builds its model in torch's ``FakeTensorMode`` (not on ``meta``: tensors a model keeps outside its
parameters and buffers, such as RoPE tables, must be on the device too). The engine then adds LoRA with peft,
whose ``add_adapter`` moves each new adapter to its base layer's device and dtype with ``Module.to``, and an
unsharded bf16 engine casts the model with ``Module.to``. torch's ``Module.to`` swaps each parameter in place,
which a fake tensor refuses ("Cannot swap t1 because it has weakref associated with it"). Inside
:func:`fake_safe_module_to`, ``Module.to`` of a module holding fake tensors replaces each parameter and buffer
that changes instead (a move to the device they are on changes nothing); other modules convert as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["fake_safe_module_to"]


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
