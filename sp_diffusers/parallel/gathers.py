"""All-gathers along the sequence: every rank's piece of a tensor, in rank order.

- :func:`all_gather_along`: masks and other non-differentiable pieces (uneven pieces padded to the longest);
- :func:`gather_ints`: a small integer vector from every rank (the handshakes; one host sync);
- :func:`gather_seq`: the ring's all-gather of K/V when dropout needs one softmax over every key,
  differentiable: its backward reduce-scatters the gradients - each rank receives the sum of every rank's
  gradient for its own piece, 1/R of the data an all-reduce moves - summing in fp32 whatever the activations'
  dtype (R partial sums of bf16 would lose bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .ledger import comm_kind

__all__ = ["Sizes", "all_gather_along", "gather_ints", "gather_seq", "uniform"]

Sizes = Sequence[int] | None  # every rank's length (rank order); None: the same on every rank


def uniform(sizes: Sizes) -> bool:
    """Whether every rank holds the same length."""
    return sizes is None or all(n == sizes[0] for n in sizes)


def all_gather_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: Sizes = None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (not differentiable; for masks).

    ``sizes``: every rank's length of ``dim`` when they differ (the other dims must agree); None when all
    ranks pass the same shape. Uneven pieces travel padded to the longest (gloo needs equal shapes) and are
    cut back. Bool tensors travel as uint8 (gloo and NCCL both accept it).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return x
    is_bool = x.dtype == torch.bool
    src = (x.to(torch.uint8) if is_bool else x).contiguous()
    longest = max(sizes) if not uniform(sizes) else None
    if longest is not None and src.shape[dim] < longest:
        pad = list(src.shape)
        pad[dim] = longest - src.shape[dim]
        src = torch.cat([src, src.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src, group=group)
    if longest is not None:
        parts = [p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)]
    out = torch.cat(parts, dim=dim)
    return out.to(torch.bool) if is_bool else out


def gather_ints(values: Sequence[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """Every rank's small integer vector (all of one length), in rank order (one collective)."""
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    with comm_kind("agreement"):
        gathered = all_gather_along(t.unsqueeze(0), 0, group)
    return gathered.tolist()


def _all_gather_dim0(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _gather_seq_impl(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sizes
) -> list[torch.Tensor]:
    """``[B, S_l, H, D] -> [B, S, H, D]`` for tensors sharing (B, S_l): one fused all-gather, rank order."""
    world = dist.get_world_size(group)
    b, s_l = tensors[0].shape[:2]
    longest = s_l if uniform(sizes) else max(sizes)
    widths = [t.shape[2] * t.shape[3] for t in tensors]
    # uneven: every rank sends `longest` rows (its own, then zeros), the padding is cut out after
    send = torch.zeros((longest, b, sum(widths)), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t, w in zip(tensors, widths, strict=True):
        send[:s_l, :, offset : offset + w].copy_(t.flatten(2).transpose(0, 1))
        offset += w
    recv = torch.empty((world * longest, b, sum(widths)), dtype=send.dtype, device=send.device)
    _all_gather_dim0(recv, send, group)
    if not uniform(sizes):
        recv = torch.cat([recv[p * longest : p * longest + n] for p, n in enumerate(sizes)])
    out, offset = [], 0
    for t, w in zip(tensors, widths, strict=True):
        out.append(recv[..., offset : offset + w].unflatten(-1, t.shape[2:]).transpose(0, 1))
        offset += w
    return out


def _reduce_scatter_dim0(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = this rank's ``dim 0`` chunk of ``inp`` summed over ``group``; an all-reduce where the backend
    has no reduce-scatter (older gloo): the same sum, every rank's chunks moved."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        scatter(out, inp, group=group)
    except (RuntimeError, NotImplementedError):
        if dist.get_backend(group) != "gloo":
            raise
        full = inp.clone()
        dist.all_reduce(full, group=group)
        out.copy_(full.view(dist.get_world_size(group), *out.shape)[dist.get_rank(group)])


class _GatherSeq(torch.autograd.Function):
    """Forward: all-gather along the sequence. Backward: every rank's gradient for my chunk, summed."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, sizes: Sizes, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        ctx.local_len = tensors[0].shape[1]
        return tuple(_gather_seq_impl(tensors, group, sizes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        group, sizes, s_l = ctx.group, ctx.sizes, ctx.local_len
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        uneven = not uniform(sizes)
        longest = max(sizes) if uneven else s_l
        widths = [g.shape[2] * g.shape[3] for g in grads]
        b = grads[0].shape[0]
        # [P * longest, B, W] in fp32: rank p's rows at p * longest (uneven pieces padded with zeros)
        packed = torch.zeros((world * longest, b, sum(widths)), dtype=torch.float32, device=grads[0].device)
        starts = [sum(sizes[:p]) for p in range(world)] if uneven else [p * s_l for p in range(world)]
        lengths = list(sizes) if uneven else [s_l] * world
        offset = 0
        for g, w in zip(grads, widths, strict=True):
            rows = g.flatten(2).transpose(0, 1)  # [S, B, W_g]
            if not uneven:
                packed[..., offset : offset + w].copy_(rows)
            for p in range(world) if uneven else ():
                packed[p * longest : p * longest + lengths[p], :, offset : offset + w].copy_(
                    rows[starts[p] : starts[p] + lengths[p]]
                )
            offset += w
        mine = torch.empty((longest, b, sum(widths)), dtype=torch.float32, device=packed.device)
        _reduce_scatter_dim0(mine, packed, group)
        mine = mine[: lengths[rank]]
        out, offset = [], 0
        for g, w in zip(grads, widths, strict=True):
            piece = mine[..., offset : offset + w].unflatten(-1, g.shape[2:]).transpose(0, 1)
            out.append(piece.to(g.dtype).contiguous())
            offset += w
        return (None, None, *out)


def gather_seq(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sizes = None
) -> list[torch.Tensor]:
    """All-gather ``[B, S_l, H, D] -> [B, S, H, D]`` along the sequence (rank order), differentiable.

    The ring dimension of Ulysses x Ring with dropout: each rank's queries attend to every rank's keys/values.
    The backward reduce-scatters: every rank's gradient for this rank's chunk, summed in fp32. Tensors must share (B, S_l); ``sizes``
    lists every rank's ``S_l`` when they differ.
    """
    if dist.get_world_size(group) == 1:
        return list(tensors)
    shapes = {tuple(t.shape[:2]) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"gather_seq needs one (B, S/R) for all tensors, got {sorted(shapes)}")
    return list(_GatherSeq.apply(group, sizes, *tensors))
