"""``return_dict=True`` fails for every model whose ``_cp_plan`` has a root ``""`` entry.

Defect: the root ``ContextParallelSplitHook`` splits the model's inputs, but its ``post_forward`` also
inspects the model's *output* and raises ``ValueError: Expected output to be a tensor or a list/tuple of
tensors`` for a ``Transformer2DModelOutput`` - even when nothing in the plan splits an output.
Affected: every release with context parallelism, 0.36-0.42 (Flux, Flux2, Wan, LTX, LTX2, and QwenImage
on 0.36). Upstream: no issue filed as of 2026-11.
Fix: when no entry of the hook's plan has ``split_output=True``, ``post_forward`` returns the output
untouched (it has nothing to do); otherwise the original runs.
"""

from __future__ import annotations

import torch

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "root_hook_return_dict"
AFFECTED = "0.36-0.42"
UPSTREAM = "none filed (hooks/context_parallel.py ContextParallelSplitHook.post_forward)"

_swaps = AttributeSwaps()


def _hook_cls():
    from diffusers.hooks.context_parallel import ContextParallelSplitHook

    return ContextParallelSplitHook


def probe() -> Probe:
    from diffusers.models._modeling_parallel import ContextParallelInput
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    hook = _hook_cls()({"hidden_states": ContextParallelInput(split_dim=1)}, None)
    try:
        hook.post_forward(None, Transformer2DModelOutput(sample=torch.zeros(1)))
    except ValueError as err:
        return Probe(True, f"root split hook rejects a Transformer2DModelOutput: {err}")
    return Probe(False, "root split hook passes non-tensor outputs through")


def apply() -> None:
    if _swaps.active:
        return
    from diffusers.models._modeling_parallel import ContextParallelInput

    cls = _hook_cls()
    original = cls.post_forward

    def post_forward(self, module, output):
        splits_output = any(
            isinstance(cpm, ContextParallelInput) and cpm.split_output for cpm in self.metadata.values()
        )
        if not splits_output:
            return output
        return original(self, module, output)

    post_forward.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(cls, "post_forward", post_forward)
    logger.info(
        "patched ContextParallelSplitHook.post_forward: outputs pass through when nothing splits them"
    )


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
