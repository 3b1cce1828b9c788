"""Differentiable collectives for Ulysses sequence parallelism.

Glossary (used in every shape comment of this package):
    B   batch                     S   global sequence length     S_l = S / P, the local sequence length
    H   heads (query or K/V)      D   head dim                   H_l = H / P, the local heads
    P   Ulysses degree (size of the process group)

The exchange packs every tensor of one call into a single ``all_to_all_single``, queries and K/V of
different lengths (cross-attention) included: a collective costs ~1 ms of latency on gloo and a launch and
a synchronisation point on NCCL, more than the layout work it saves. A tensor that needs no gradient (a key
mask riding along with K/V) gets none back in the backward exchange. The layouts (one copy per tensor and
direction, the received queries/keys/values strided views of the receive buffer) are in
``sp_diffusers.exchange``.

Nothing here knows about attention, models or training.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# the layouts and buffers live in sp_diffusers.exchange, the all-gathers in sp_diffusers.gathers; importable
# from here as before
from .exchange import _heads_to_seq_impl, _seq_to_heads_impl, release_buffers
from .gathers import Sizes, all_gather_along, gather_ints, gather_seq

__all__ = [
    "Sizes",
    "all_gather_along",
    "gather_ints",
    "gather_seq",
    "heads_to_seq",
    "release_buffers",
    "seq_to_heads",
    "split_sizes",
    "to_all_to_all_order",
]


def split_sizes(total: int, world: int) -> list[int]:
    """How a length ``total`` is split over ``world`` ranks: ``torch.tensor_split``'s rule (the first
    ``total % world`` ranks hold one more), which diffusers' uneven sharding and sp-diffusers' share."""
    return [total // world + (r < total % world) for r in range(world)]


def _exchange_grads(ctx, grads: Sequence[torch.Tensor], impl) -> tuple:
    """The inverse exchange of the gradients of the inputs that need one (a mask riding along gets None)."""
    needed = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
    result: list[torch.Tensor | None] = [None] * len(grads)
    if needed:
        exchanged = impl([grads[i] for i in needed], ctx.group, [ctx.sizes[i] for i in needed])
        for i, g in zip(needed, exchanged, strict=True):
            result[i] = g
    return (None, None, *result)


class _SeqToHeads(torch.autograd.Function):
    """Forward: sequence-sharded -> head-sharded. Backward: the inverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, sizes: Sequence[Sizes], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        out = tuple(_seq_to_heads_impl(tensors, group, sizes))
        ctx.mark_non_differentiable(*(o for o, t in zip(out, tensors, strict=True) if not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return _exchange_grads(ctx, grads, _heads_to_seq_impl)


class _HeadsToSeq(torch.autograd.Function):
    """Forward: head-sharded -> sequence-sharded. Backward: the inverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, sizes: Sequence[Sizes], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        out = tuple(_heads_to_seq_impl(tensors, group, sizes))
        ctx.mark_non_differentiable(*(o for o, t in zip(out, tensors, strict=True) if not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return _exchange_grads(ctx, grads, _seq_to_heads_impl)


def _check_shapes(
    tensors: Sequence[torch.Tensor], world: int, sizes: Sequence[Sizes], head_sharded: bool
) -> None:
    """4-D tensors; heads divide the degree (before the exchange); a global length matches its sizes."""
    for t, n in zip(tensors, sizes, strict=True):
        if t.dim() != 4:
            raise ValueError(f"expected a 4-D tensor [B, S, H, D], got shape {tuple(t.shape)}")
        if not head_sharded and t.shape[2] % world:
            raise ValueError(
                f"number of heads ({t.shape[2]}) must be divisible by the Ulysses degree ({world}); "
                f"shape {tuple(t.shape)}"
            )
        if n is not None and (len(n) != world or any(x < 0 for x in n)):
            raise ValueError(f"sizes={list(n)} must give a length >= 0 for each of the {world} ranks")
        if head_sharded and n is None and t.shape[1] % world:
            raise ValueError(
                f"sequence length ({t.shape[1]}) must be divisible by the Ulysses degree ({world}) unless "
                f"its per-rank sizes are given; shape {tuple(t.shape)}"
            )
        if head_sharded and n is not None and t.shape[1] != sum(n):
            raise ValueError(f"sequence length {t.shape[1]} != the sum of sizes {list(n)}")


def seq_to_heads(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sequence[Sizes] | None = None
) -> list[torch.Tensor]:
    """All-to-all ``[B, S_l, H, D] -> [B, S, H/P, D]`` for every tensor, differentiable.

    Rank r receives heads ``[r*H/P, (r+1)*H/P)`` of the whole sequence, sequence chunks in rank order.
    ``sizes[i]`` lists tensor i's local length on every rank (uneven sharding; ``S`` is their sum), None
    when all ranks hold the same ``S_l``. Tensors may differ in H, D and S (each distinct (B, sizes) costs
    one collective). The results are strided views; SDPA consumes them as they are.
    """
    world = dist.get_world_size(group)
    sizes = list(sizes) if sizes is not None else [None] * len(tensors)
    _check_shapes(tensors, world, sizes, head_sharded=False)
    rank = dist.get_rank(group)
    for t, n in zip(tensors, sizes, strict=True):
        if n is not None and t.shape[1] != n[rank]:
            raise ValueError(f"local sequence length {t.shape[1]} != this rank's entry of sizes {list(n)}")
    if world == 1:
        return list(tensors)
    return list(_SeqToHeads.apply(group, sizes, *tensors))


def heads_to_seq(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sequence[Sizes] | None = None
) -> list[torch.Tensor]:
    """All-to-all ``[B, S, H/P, D] -> [B, S_l, H, D]`` for every tensor, differentiable; inverse of
    :func:`seq_to_heads` (``sizes`` as there: the local lengths to cut ``S`` into). Outputs are contiguous."""
    world = dist.get_world_size(group)
    sizes = list(sizes) if sizes is not None else [None] * len(tensors)
    _check_shapes(tensors, world, sizes, head_sharded=True)
    if world == 1:
        return list(tensors)
    return list(_HeadsToSeq.apply(group, sizes, *tensors))


def to_all_to_all_order(x: torch.Tensor, dim: int, first: list[int], second: list[int]) -> torch.Tensor:
    """Reorder ``dim`` of ``x`` from stream order to the key order the all-to-all produces.

    ``first``/``second`` are every rank's lengths of the two streams; ``x.shape[dim] == sum(first) +
    sum(second)``, laid out ``[first stream, second stream]`` (the order of one process). Returns it as
    ``[first_0, second_0, first_1, second_1, ...]``, the order in which Ulysses concatenates each rank's
    ``cat([first_r, second_r])`` chunk.
    """
    dim = dim % x.dim()
    a, b = x.split([sum(first), sum(second)], dim=dim)
    pieces = [t for pair in zip(a.split(first, dim=dim), b.split(second, dim=dim), strict=True) for t in pair]
    return torch.cat(pieces, dim=dim)
