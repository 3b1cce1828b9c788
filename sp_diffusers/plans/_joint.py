"""What the joint-stream plans share: reordering a stream-order mask into the all-to-all's key order, the
text key mask of two sharded streams, and a clear error where a stream does not divide the degree.

Under a plan that splits a video (or image) stream of N tokens and a text stream of T tokens, rank r attends
over ``cat([first_r, second_r])`` and the Ulysses all-to-all concatenates those chunks in rank order, so keys
arrive as ``[first_0, second_0, first_1, second_1, ...]``: not the single-process order ``[first, second]``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..cp_groups import cp_world

__all__ = [
    "block_parallel_config",
    "bound_args",
    "check_streams_divide",
    "text_key_mask",
    "to_all_to_all_order",
]


def to_all_to_all_order(
    x: torch.Tensor, dim: int, first_local: int, second_local: int, world: int
) -> torch.Tensor:
    """Reorder ``dim`` of ``x`` from stream order to the key order the all-to-all produces.

    ``x.shape[dim] == world * (first_local + second_local)``, laid out ``[first (world * first_local), second
    (world * second_local)]`` (the order of one process); returns it as ``[first_0, second_0, first_1, second_1,
    ...]``, the order in which Ulysses concatenates each rank's ``cat([first_r, second_r])`` chunk.
    """
    dim = dim % x.dim()
    first, second = x.split([world * first_local, world * second_local], dim=dim)
    first = first.unflatten(dim, (world, first_local))  # [..., P, first_local, ...]
    second = second.unflatten(dim, (world, second_local))  # [..., P, second_local, ...]
    return torch.cat([first, second], dim=dim + 1).flatten(dim, dim + 1)


def text_key_mask(
    text_mask: torch.Tensor, text_local: int, other_local: int, world: int, text_first: bool, processor: str
) -> torch.Tensor:
    """``[B, T]`` text mask (global, padded length) -> ``[B, 1, 1, keys]`` mask of the joint keys, in the
    order attention sees them: rank chunks ``cat([text_r, other_r])`` (or ``[other_r, text_r]``) concatenated.

    4-D on purpose: diffusers 0.36's native backend hands a 2-D mask to SDPA unchanged (no key-padding reading).
    """
    if text_mask.dim() != 2 or text_mask.shape[1] != world * text_local:
        raise ValueError(
            f"{processor}: encoder_hidden_states_mask must be [B, T] over the global (padded) text length "
            f"{world * text_local}, got shape {tuple(text_mask.shape)}; fix: pass the [B, T] mask of the "
            "encoder_hidden_states given to the model (e.g. from sp_diffusers.padding.pad_text_batch)"
        )
    batch = text_mask.shape[0]
    text = text_mask.to(torch.bool).unflatten(1, (world, text_local))  # [B, P, T/P]
    other = torch.ones((batch, world, other_local), dtype=torch.bool, device=text_mask.device)
    parts = [text, other] if text_first else [other, text]
    return torch.cat(parts, dim=2).flatten(1)[:, None, None, :]  # [B, 1, 1, P * (T/P + N/P)]


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


class _StreamsDivide:
    """Forward pre-hook of the block where a plan splits the video and text streams: under context parallelism
    both lengths must divide the degree. diffusers' sharder would only assert; this names the fix. It runs
    before diffusers' split hook (torch pre-hooks precede the hook-wrapped ``forward``)."""

    def __init__(self, model: str, text_fix: str) -> None:
        self.model, self.text_fix = model, text_fix

    def __call__(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        world = cp_world(block_parallel_config(block))
        if world == 1:
            return
        _, bound = bound_args(block, args, kwargs)
        video, text = bound.get("hidden_states"), bound.get("encoder_hidden_states")
        if torch.is_tensor(text) and text.shape[1] % world:
            raise ValueError(
                f"{self.model}: encoder_hidden_states has {text.shape[1]} tokens, not divisible by the context-"
                f"parallel degree {world}; fix: pad the text to a multiple of {world} with "
                f"sp_diffusers.padding.pad_text_batch and {self.text_fix}"
            )
        if torch.is_tensor(video) and video.shape[1] % world:
            raise ValueError(
                f"{self.model}: the video has {video.shape[1]} tokens (frames x height x width after patching), "
                f"not divisible by the context-parallel degree {world}; fix: choose a frame count or size whose "
                f"token count is a multiple of {world}, or a degree that divides {video.shape[1]}"
            )


def check_streams_divide(block: torch.nn.Module, model: str, text_fix: str) -> None:
    if not getattr(block, "_sp_diffusers_divisibility_hook", False):
        block.register_forward_pre_hook(_StreamsDivide(model, text_fix), with_kwargs=True)
        block._sp_diffusers_divisibility_hook = True
