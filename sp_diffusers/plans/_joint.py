"""What the joint-stream plans share: reordering a stream-order mask into the all-to-all's key order, the
text key mask of two sharded streams, and a clear error where a stream does not divide the degree.

Under a plan that splits a video (or image) stream of N tokens and a text stream of T tokens, rank r attends
over ``cat([first_r, second_r])`` and the Ulysses all-to-all concatenates those chunks in rank order, so keys
arrive as ``[first_0, second_0, first_1, second_1, ...]``: not the single-process order ``[first, second]``.
Ranks may hold different lengths of each stream (any sequence length): the helpers take every rank's
lengths, which :func:`stream_sizes` gathers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..comm import to_all_to_all_order
from ..cp_groups import stream_sizes

__all__ = [
    "block_parallel_config",
    "bound_args",
    "stream_sizes",
    "text_key_mask",
    "to_all_to_all_order",
]


def text_key_mask(
    text_mask: torch.Tensor, text: list[int], other: list[int], text_first: bool, processor: str
) -> torch.Tensor:
    """``[B, T]`` text mask (global, padded length) -> ``[B, 1, 1, keys]`` mask of the joint keys, in the
    order attention sees them: rank chunks ``cat([text_r, other_r])`` (or ``[other_r, text_r]``) concatenated.
    ``text``/``other`` are every rank's lengths of the two streams.

    4-D on purpose: diffusers 0.36's native backend hands a 2-D mask to SDPA unchanged (no key-padding reading).
    """
    if text_mask.dim() != 2 or text_mask.shape[1] != sum(text):
        raise ValueError(
            f"{processor}: encoder_hidden_states_mask must be [B, T] over the global (padded) text length "
            f"{sum(text)}, got shape {tuple(text_mask.shape)}; fix: pass the [B, T] mask of the "
            "encoder_hidden_states given to the model (e.g. from sp_diffusers.padding.pad_text_batch)"
        )
    batch = text_mask.shape[0]
    others = torch.ones((batch, sum(other)), dtype=torch.bool, device=text_mask.device)
    joint = torch.cat(
        [text_mask.to(torch.bool), others] if text_first else [others, text_mask.to(torch.bool)], 1
    )
    order = (text, other) if text_first else (other, text)
    return to_all_to_all_order(joint, 1, *order)[:, None, None, :]  # [B, 1, 1, T + N]


def block_parallel_config(block: torch.nn.Module) -> Any:
    """The ``ParallelConfig`` of ``block``'s attention (set by ``enable_parallelism``), or None."""
    for module in block.modules():
        config = getattr(getattr(module, "processor", None), "_parallel_config", None)
        if config is not None:
            return config
    return None


def bound_args(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], dict[str, Any]]:
    """``module.forward``'s parameter names (without self) and the call's arguments by name."""
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    return names, dict(zip(names, args, strict=False)) | kwargs
