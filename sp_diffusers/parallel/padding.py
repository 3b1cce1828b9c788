"""SP-aligned padding of text embeddings and masks (and the inverse).

Under Ulysses every sequence that diffusers splits must divide the SP degree. Text is ragged: prompts
differ in length, and a batch is padded to its longest prompt, then to a multiple of the SP degree.
Padding is 0 in the embeddings and False in the mask, so padded tokens are never attended to and the
result equals the unpadded computation wherever the model honours the mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .devices import to_device

__all__ = ["PaddingError", "length_bucket", "pad_text_batch", "pad_to_multiple", "round_up", "strip_padding"]


class PaddingError(ValueError):
    """Text embeddings and masks that disagree; the message names both shapes."""


def length_bucket(n: int, multiple: int = 1) -> int:
    """The padded length of a sequence of ``n`` in a compiled model: the next power of two (at least 16), a
    multiple of ``multiple``. A run's ragged prompts then take a handful of shapes, each one compiled graph."""
    return round_up(max(16, 1 << max(n - 1, 0).bit_length()), multiple)


def round_up(n: int, multiple: int) -> int:
    if multiple < 1:
        raise PaddingError(f"multiple must be >= 1, got {multiple}")
    return -(-n // multiple) * multiple


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1, value: float | bool = 0) -> torch.Tensor:
    """Pad ``dim`` of ``x`` at the end to a multiple of ``multiple`` with ``value``."""
    length = x.shape[dim]
    target = round_up(length, multiple)
    if target == length:
        return x
    shape = list(x.shape)
    shape[dim] = target - length
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim=dim)


def pad_text_batch(
    embeds: torch.Tensor | Sequence[torch.Tensor],
    mask: torch.Tensor | Sequence[torch.Tensor] | None = None,
    multiple: int = 1,
    name: str = "prompt_embeds",
    bucket: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged or padded text -> ``([B, L, D], [B, L] bool)`` with ``L`` a multiple of ``multiple`` (``bucket``:
    :func:`length_bucket`'s length).

    ``embeds`` is a dense ``[B, L_max, D]`` tensor (then ``mask`` ``[B, L_max]`` says which tokens are real;
    None means all are) or a list of ``[L_i, D]`` tensors (then ``mask`` may be None or a list of ``[L_i]``).
    Padded positions are 0 in the embeddings and False in the mask.
    """
    if isinstance(embeds, torch.Tensor):
        if embeds.dim() != 3:
            raise PaddingError(
                f"{name} must be [B, L, D] or a list of [L_i, D], got shape {tuple(embeds.shape)}"
            )
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(embeds.shape[:2]):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise PaddingError(
                f"{name}_mask shape {got} does not match {name} shape {tuple(embeds.shape)}: expected "
                f"{tuple(embeds.shape[:2])}; fix: pass the mask that came with these embeddings"
            )
        dense, dense_mask = embeds, to_device(mask, embeds.device).to(torch.bool)
        dense = dense.masked_fill(~dense_mask[..., None], 0)
    else:
        items = list(embeds)
        if not items:
            raise PaddingError(f"{name} is an empty list")
        dims = {t.shape[-1] for t in items}
        if any(t.dim() != 2 for t in items) or len(dims) != 1:
            raise PaddingError(
                f"{name} list items must all be [L_i, D] with one D, got {[tuple(t.shape) for t in items]}"
            )
        masks = (
            list(mask)
            if mask is not None
            else [torch.ones(t.shape[0], dtype=torch.bool, device=t.device) for t in items]
        )
        if len(masks) != len(items) or any(
            m.shape != t.shape[:1] for m, t in zip(masks, items, strict=False)
        ):
            raise PaddingError(
                f"{name}_mask lengths {[tuple(m.shape) for m in masks]} do not match {name} lengths "
                f"{[t.shape[0] for t in items]}"
            )
        longest = max(t.shape[0] for t in items)
        dense = items[0].new_zeros((len(items), longest, items[0].shape[-1]))
        dense_mask = torch.zeros((len(items), longest), dtype=torch.bool, device=items[0].device)
        for i, (t, m) in enumerate(zip(items, masks, strict=True)):
            keep = to_device(m, dense.device).to(torch.bool)
            dense[i, : t.shape[0]] = to_device(t, dense.device).masked_fill(~keep[:, None], 0)
            dense_mask[i, : t.shape[0]] = keep
    if bucket:
        multiple = length_bucket(dense.shape[1], multiple)
    return pad_to_multiple(dense, multiple, 1, 0), pad_to_multiple(dense_mask, multiple, 1, False)


def strip_padding(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The inverse for contiguous (left-aligned) masks: ``[B, L, D]`` + ``[B, L]`` -> list of ``[L_i, D]``."""
    return [e[m.to(torch.bool)] for e, m in zip(embeds, mask, strict=True)]
