"""Differentiable collectives for Ulysses sequence parallelism.

Glossary (used in every shape comment of this package):
    B   batch                     S   global sequence length     S_l = S / P, the local sequence length
    H   heads (query or K/V)      D   head dim                   H_l = H / P, the local heads
    P   Ulysses degree (size of the process group)

The exchange packs every tensor of one call into a single ``all_to_all_single``: a collective costs
~1 ms of latency on gloo, more than the layout work it saves. The send buffer is laid out
``[P, S_l, B, W]`` (W = sum of H_l * D over the packed tensors), destination rank first, so that after
the exchange the source-rank dim and ``S_l`` are adjacent and merge into ``S`` without a copy: the
received tensors are strided views, one layout copy in total on the way in.

Nothing here knows about attention, models or training.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_along",
    "gather_ints",
    "gather_seq",
    "heads_to_seq",
    "seq_to_heads",
]


# Send buffers are reused on CPU: a fresh multi-MB buffer page-faults on its first write, which made the
# packing copy cost ~2.5x the all-to-all itself on gloo (8 ms vs 3 ms at S=4096, H=8, D=64). A send
# buffer is free again as soon as the (synchronous) collective returns. CUDA's caching allocator already
# recycles memory, so there every buffer is a plain torch.empty.
_SEND_BUFFERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _send_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    buf = _SEND_BUFFERS.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _SEND_BUFFERS[(dtype, device)] = buf
    return buf[:numel].view(shape)


def release_buffers() -> None:
    """Drop the cached CPU send buffers (they are rebuilt on the next exchange)."""
    _SEND_BUFFERS.clear()


def _bucket_key(t: torch.Tensor, seq_dim_len: int) -> tuple:
    return (t.shape[0], seq_dim_len, t.dtype, t.device)


def _seq_to_heads_impl(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """``[B, S_l, H, D] -> [B, S, H/P, D]`` for each tensor; tensors sharing (B, S_l) share one collective."""
    world = dist.get_world_size(group)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault(_bucket_key(t, t.shape[1]), []).append(i)

    for (b, s_l, dtype, device), idx in buckets.items():
        widths = [tensors[i].shape[2] // world * tensors[i].shape[3] for i in idx]
        send = _send_buffer((world, s_l, b, sum(widths)), dtype, device)
        offset = 0
        for i, w in zip(idx, widths, strict=True):
            t = tensors[i]
            h_l, d = t.shape[2] // world, t.shape[3]
            # [B, S_l, P, H_l, D] -> [P, S_l, B, H_l, D]: the only layout copy of this direction.
            send[..., offset : offset + w].unflatten(-1, (h_l, d)).copy_(
                t.unflatten(2, (world, h_l)).permute(2, 1, 0, 3, 4)
            )
            offset += w
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        recv = recv.view(world * s_l, b, -1)  # [P, S_l, B, W] -> [S, B, W], free
        offset = 0
        for i, w in zip(idx, widths, strict=True):
            h_l, d = tensors[i].shape[2] // world, tensors[i].shape[3]
            # [S, B, H_l, D] -> [B, S, H_l, D] as a strided view
            out[i] = recv[..., offset : offset + w].unflatten(-1, (h_l, d)).transpose(0, 1)
            offset += w
    return out  # type: ignore[return-value]


def _heads_to_seq_impl(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """``[B, S, H_l, D] -> [B, S/P, H_l * P, D]`` for each tensor; the exact inverse of ``_seq_to_heads_impl``."""
    world = dist.get_world_size(group)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault(_bucket_key(t, t.shape[1]), []).append(i)

    for (b, s, dtype, device), idx in buckets.items():
        s_l = s // world
        widths = [tensors[i].shape[2] * tensors[i].shape[3] for i in idx]
        if len(idx) == 1 and tensors[idx[0]].transpose(0, 1).is_contiguous():
            # SDPA writes its output in the query's layout, and the queries came out of seq_to_heads as
            # [S, B, H_l, D] in memory: that already is the send layout [P, S_l, B, W], so no pack copy.
            send = tensors[idx[0]].transpose(0, 1).reshape(world, s_l, b, widths[0])
        else:
            send = _send_buffer((world, s_l, b, sum(widths)), dtype, device)
            offset = 0
            for i, w in zip(idx, widths, strict=True):
                t = tensors[i]
                h_l, d = t.shape[2], t.shape[3]
                # [B, P, S_l, H_l, D] -> [P, S_l, B, H_l, D]
                send[..., offset : offset + w].unflatten(-1, (h_l, d)).copy_(
                    t.unflatten(1, (world, s_l)).permute(1, 2, 0, 3, 4)
                )
                offset += w
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        offset = 0
        for i, w in zip(idx, widths, strict=True):
            h_l, d = tensors[i].shape[2], tensors[i].shape[3]
            # [P, S_l, B, H_l, D] -> [B, S_l, P, H_l, D] -> [B, S_l, H, D]: heads of source rank p land at
            # p * H_l, which is the head order of the unsharded tensor. The reshape is the receive copy.
            out[i] = (
                recv[..., offset : offset + w]
                .unflatten(-1, (h_l, d))
                .permute(2, 1, 0, 3, 4)
                .reshape(b, s_l, world * h_l, d)
            )
            offset += w
    return out  # type: ignore[return-value]


class _SeqToHeads(torch.autograd.Function):
    """Forward: sequence-sharded -> head-sharded. Backward: the inverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        return tuple(_seq_to_heads_impl(tensors, group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, *_heads_to_seq_impl(grads, ctx.group))


class _HeadsToSeq(torch.autograd.Function):
    """Forward: head-sharded -> sequence-sharded. Backward: the inverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        return tuple(_heads_to_seq_impl(tensors, group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, *_seq_to_heads_impl(grads, ctx.group))


def _check_divisible(tensors: Sequence[torch.Tensor], dim: int, world: int, what: str) -> None:
    for t in tensors:
        if t.dim() != 4:
            raise ValueError(f"expected a 4-D tensor [B, S, H, D], got shape {tuple(t.shape)}")
        if t.shape[dim] % world:
            raise ValueError(
                f"{what} ({t.shape[dim]}) must be divisible by the Ulysses degree ({world}); "
                f"shape {tuple(t.shape)}"
            )


def seq_to_heads(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-to-all ``[B, S/P, H, D] -> [B, S, H/P, D]`` for every tensor, differentiable.

    Rank r receives heads ``[r*H/P, (r+1)*H/P)`` of the whole sequence, sequence chunks in rank order.
    Tensors may differ in H, D and S (each distinct (B, S/P) costs one collective). The results are
    strided views; SDPA consumes them as they are.
    """
    world = dist.get_world_size(group)
    _check_divisible(tensors, 2, world, "number of heads")
    if world == 1:
        return list(tensors)
    return list(_SeqToHeads.apply(group, *tensors))


def heads_to_seq(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-to-all ``[B, S, H/P, D] -> [B, S/P, H, D]`` for every tensor, differentiable; inverse of
    :func:`seq_to_heads`. Outputs are contiguous."""
    world = dist.get_world_size(group)
    _check_divisible(tensors, 1, world, "sequence length")
    if world == 1:
        return list(tensors)
    return list(_HeadsToSeq.apply(group, *tensors))


def all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (not differentiable; for masks).

    All ranks must pass the same shape. Bool tensors travel as uint8 (gloo and NCCL both accept it).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return x
    is_bool = x.dtype == torch.bool
    src = (x.to(torch.uint8) if is_bool else x).contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src, group=group)
    out = torch.cat(parts, dim=dim)
    return out.to(torch.bool) if is_bool else out


def gather_ints(values: Sequence[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """Every rank's small integer vector, in rank order (one collective)."""
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = all_gather_along(t.unsqueeze(0), 0, group)
    return gathered.tolist()


def _all_gather_dim0(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _gather_seq_impl(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """``[B, S/R, H, D] -> [B, S, H, D]`` for tensors sharing (B, S/R): one fused all-gather, rank order."""
    world = dist.get_world_size(group)
    b, s_l = tensors[0].shape[:2]
    widths = [t.shape[2] * t.shape[3] for t in tensors]
    send = torch.empty((s_l, b, sum(widths)), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t, w in zip(tensors, widths, strict=True):
        send[..., offset : offset + w].copy_(t.flatten(2).transpose(0, 1))
        offset += w
    recv = torch.empty((world * s_l, b, sum(widths)), dtype=send.dtype, device=send.device)
    _all_gather_dim0(recv, send, group)
    out, offset = [], 0
    for t, w in zip(tensors, widths, strict=True):
        out.append(recv[..., offset : offset + w].unflatten(-1, t.shape[2:]).transpose(0, 1))
        offset += w
    return out


class _GatherSeq(torch.autograd.Function):
    """Forward: all-gather along the sequence. Backward: every rank's gradient for my chunk, summed."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group = group
        ctx.local_len = tensors[0].shape[1]
        return tuple(_gather_seq_impl(tensors, group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        rank, s_l = dist.get_rank(ctx.group), ctx.local_len
        widths = [g.shape[2] * g.shape[3] for g in grads]
        b = grads[0].shape[0]
        packed = torch.empty(
            (grads[0].shape[1], b, sum(widths)), dtype=grads[0].dtype, device=grads[0].device
        )
        offset = 0
        for g, w in zip(grads, widths, strict=True):
            packed[..., offset : offset + w].copy_(g.flatten(2).transpose(0, 1))
            offset += w
        # gloo has no reduce_scatter: all-reduce the packed gradients and keep this rank's chunk
        dist.all_reduce(packed, group=ctx.group)
        mine = packed[rank * s_l : (rank + 1) * s_l]
        out, offset = [], 0
        for g, w in zip(grads, widths, strict=True):
            out.append(mine[..., offset : offset + w].unflatten(-1, g.shape[2:]).transpose(0, 1).contiguous())
            offset += w
        return (None, *out)


def gather_seq(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-gather ``[B, S/R, H, D] -> [B, S, H, D]`` along the sequence (rank order), differentiable.

    The ring dimension of Ulysses x Ring: each rank's queries attend to every rank's keys/values. The
    backward sums every rank's gradient for this rank's chunk. Tensors must share (B, S/R).
    """
    if dist.get_world_size(group) == 1:
        return list(tensors)
    shapes = {tuple(t.shape[:2]) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"gather_seq needs one (B, S/R) for all tensors, got {sorted(shapes)}")
    return list(_GatherSeq.apply(group, *tensors))
