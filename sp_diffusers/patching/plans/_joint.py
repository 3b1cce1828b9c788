"""What the joint-stream plans share: reordering a stream-order mask into the all-to-all's key order, the
text key mask of two sharded streams, and a clear error where a stream does not divide the degree.

Under a plan that splits a video (or image) stream of N tokens and a text stream of T tokens, rank r attends
over ``cat([first_r, second_r])`` and the Ulysses all-to-all concatenates those chunks in rank order, so keys
arrive as ``[first_0, second_0, first_1, second_1, ...]``: not the single-process order ``[first, second]``.
Ranks may hold different lengths of each stream (any sequence length): the helpers take every rank's
lengths, which :func:`joint_sizes` reads from the forward's record of the plan's splits (no communication).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...parallel.agreement import stream_sizes as recorded_sizes
from ...parallel.cp_groups import cp_groups, stream_sizes
from ...parallel.exchange import to_all_to_all_order

__all__ = [
    "attend",
    "block_parallel_config",
    "bound_args",
    "joint_sizes",
    "text_key_mask",
    "to_all_to_all_order",
]


def joint_sizes(config: Any, names: list[str], counts: list[int], device: torch.device) -> list[list[int]]:
    """Every context-parallel rank's lengths of the plan's streams ``names`` (split names, see
    ``sp_diffusers.patching.scope_hooks``; ``counts`` = this rank's), one list per stream.

    Read from the forward's record of its splits, where the plan split them: no communication. A stream the
    record does not know (a call outside a plan-driven forward) is gathered instead: one collective and a
    host sync, on every rank alike (the record is the same on every rank)."""
    sizes = recorded_sizes(config, names)
    if sizes is None:
        return stream_sizes(config, counts, device)
    rank = cp_groups(config).cp_rank
    mine = [s[rank] for s in sizes]
    if mine != list(counts):
        raise ValueError(
            f"sp_diffusers plan: this rank holds {counts} tokens of the streams {names}, but the plan split "
            f"{mine}; a processor read the wrong split. Fix: report this with the model class"
        )
    return sizes


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
            "encoder_hidden_states given to the model (e.g. from sp_diffusers.parallel.padding.pad_text_batch)"
        )
    batch = text_mask.shape[0]
    others = torch.ones((batch, sum(other)), dtype=torch.bool, device=text_mask.device)
    joint = torch.cat(
        [text_mask.to(torch.bool), others] if text_first else [others, text_mask.to(torch.bool)], 1
    )
    order = (text, other) if text_first else (other, text)
    return to_all_to_all_order(joint, 1, *order)[:, None, None, :]  # [B, 1, 1, T + N]


def attend(
    processor: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any
) -> torch.Tensor:
    """``[B, S, H, D]`` q, k, v -> ``[B, S, H * D]``: attention through diffusers' dispatcher with
    ``processor``'s backend and parallel config (so ``ulysses_sdpa`` and context parallelism apply)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    backend, config = processor._attention_backend, processor._parallel_config
    out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend=backend, parallel_config=config)
    return out.flatten(2, 3).to(query.dtype)


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
