"""Qwen-Image's joint text/image mask is in the wrong order under sequence parallelism.

Defect: ``QwenImageTransformer2DModel.forward`` builds one joint key-padding mask
``[text_0 .. text_{P-1}, image_0 .. image_{P-1}]`` over the full text and image lengths, but under
context parallelism each rank attends over ``cat([text_r, image_r])`` and the all-to-all gathers the
keys as ``[text_0, image_0, text_1, image_1, ...]``. Mask and keys disagree: padded text tokens are
attended to and real ones masked (0.38: forward error 2.6e-2, gradients off by 112%; 0.37: a shape
error for batch > 1, otherwise wrong). 0.36 ignores the mask altogether (with or without CP) and 0.39+
builds the mask per block from the split text mask (diffusers#13756), which is already in key order.
Affected: diffusers 0.37.x and 0.38.x. Upstream: diffusers#13756 (fixed in 0.39.0).
Fix: the double-stream attention processor reorders a global-length joint mask into the order the
all-to-all produces, as a bool mask, before attention.
"""

from __future__ import annotations

import inspect

import torch

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "qwenimage_joint_mask"
AFFECTED = "0.37-0.38"
UPSTREAM = "diffusers#13756 (fixed in 0.39.0)"

_swaps = AttributeSwaps()


def _module():
    from diffusers.models.transformers import transformer_qwenimage

    return transformer_qwenimage


def probe() -> Probe:
    mod = _module()
    forward_src = inspect.getsource(mod.QwenImageTransformer2DModel.forward)
    if "joint_attention_mask" not in forward_src:
        return Probe(
            False, "the model builds no global joint mask (0.36 ignores masks; 0.39+ builds it per block)"
        )
    return Probe(
        True, "forward builds the joint mask over global text+image lengths, not in all-to-all order"
    )


def reorder_joint_mask(mask: torch.Tensor, text: list[int], image: list[int]) -> torch.Tensor:
    """``[.., text (all ranks), image (all ranks)]`` -> ``[.., text_0, image_0, text_1, image_1, ..]`` as a bool
    mask; ``text``/``image`` are every rank's lengths of the two streams."""
    from ...parallel.exchange import to_all_to_all_order

    return to_all_to_all_order(mask, -1, text, image).to(torch.bool)


def apply() -> None:
    if _swaps.active:
        return
    from ...parallel.cp_groups import cp_world
    from ..plans._joint import joint_sizes

    cls = _module().QwenDoubleStreamAttnProcessor2_0
    original = cls.__call__
    signature = inspect.signature(original)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        bound = signature.bind(self, attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        config = getattr(self, "_parallel_config", None)
        if mask is not None and encoder_hidden_states is not None and cp_world(config) > 1:
            # the plan splits both streams where they enter the first block: their sizes are on record
            text, image = joint_sizes(
                config,
                [":encoder_hidden_states", ":hidden_states"],
                [encoder_hidden_states.shape[1], hidden_states.shape[1]],
                hidden_states.device,
            )
            if mask.shape[-1] == sum(text) + sum(image):
                bound.arguments["attention_mask"] = reorder_joint_mask(mask, text, image)
        return original(*bound.args, **bound.kwargs)

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(cls, "__call__", __call__)
    logger.info("patched QwenDoubleStreamAttnProcessor2_0: joint mask reordered to all-to-all key order")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
