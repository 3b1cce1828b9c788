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
    "Sizes",
    "all_gather_along",
    "gather_ints",
    "gather_seq",
    "heads_to_seq",
    "seq_to_heads",
    "split_sizes",
    "to_all_to_all_order",
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
    # a buffer made under torch.inference_mode() is an inference tensor: writing it outside inference mode
    # (the next training forward) is refused by autograd, so it is replaced, and vice versa
    if buf is None or buf.numel() < numel or buf.is_inference() != torch.is_inference_mode_enabled():
        buf = torch.empty(numel, dtype=dtype, device=device)
        _SEND_BUFFERS[(dtype, device)] = buf
    return buf[:numel].view(shape)


def release_buffers() -> None:
    """Drop the cached CPU send buffers (they are rebuilt on the next exchange)."""
    _SEND_BUFFERS.clear()


Sizes = Sequence[int] | None  # per-rank local sequence lengths (rank order); None: equal, S_l on every rank


def split_sizes(total: int, world: int) -> list[int]:
    """How a length ``total`` is split over ``world`` ranks: ``torch.tensor_split``'s rule (the first
    ``total % world`` ranks hold one more), which diffusers' uneven sharding and sp-diffusers' share."""
    return [total // world + (r < total % world) for r in range(world)]


def _uniform(sizes: Sizes) -> bool:
    return sizes is None or all(n == sizes[0] for n in sizes)


def _seq_to_heads_impl(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sequence[Sizes]
) -> list[torch.Tensor]:
    """``[B, S_l, H, D] -> [B, S, H/P, D]`` for each tensor; tensors sharing (B, sizes) share one collective.

    Every destination gets all of this rank's ``S_l`` rows (of its own heads), so the send splits are equal;
    from source ``p`` arrive ``sizes[p]`` rows, which the receive splits carry.
    """
    world = dist.get_world_size(group)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        key = (t.shape[0], t.shape[1], None if _uniform(sizes[i]) else tuple(sizes[i]), t.dtype, t.device)
        buckets.setdefault(key, []).append(i)

    for (b, s_l, uneven, dtype, device), idx in buckets.items():
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
        if uneven is None:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            recv = recv.view(world * s_l, b, send.shape[-1])  # [P, S_l, B, W] -> [S, B, W], free
        else:
            # [S, B, W] with source p's rows at its offset: the same free view, split sizes per source
            recv = torch.empty((sum(uneven), b, send.shape[-1]), dtype=dtype, device=device)
            dist.all_to_all_single(
                recv, send.view(world * s_l, b, send.shape[-1]), list(uneven), [s_l] * world, group=group
            )
        offset = 0
        for i, w in zip(idx, widths, strict=True):
            h_l, d = tensors[i].shape[2] // world, tensors[i].shape[3]
            # [S, B, H_l, D] -> [B, S, H_l, D] as a strided view
            out[i] = recv[..., offset : offset + w].unflatten(-1, (h_l, d)).transpose(0, 1)
            offset += w
    return out  # type: ignore[return-value]


def _heads_to_seq_impl(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sequence[Sizes]
) -> list[torch.Tensor]:
    """``[B, S, H_l, D] -> [B, S_l, H_l * P, D]`` for each tensor; the exact inverse of ``_seq_to_heads_impl``.

    Destination ``p`` gets rows ``[offset_p, offset_p + sizes[p])``; from every source arrive this rank's
    ``S_l`` rows (of the source's heads): equal receive splits.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        key = (t.shape[0], t.shape[1], None if _uniform(sizes[i]) else tuple(sizes[i]), t.dtype, t.device)
        buckets.setdefault(key, []).append(i)

    for (b, s, uneven, dtype, device), idx in buckets.items():
        s_l = s // world if uneven is None else uneven[rank]
        widths = [tensors[i].shape[2] * tensors[i].shape[3] for i in idx]
        if len(idx) == 1 and tensors[idx[0]].transpose(0, 1).is_contiguous():
            # SDPA writes its output in the query's layout, and the queries came out of seq_to_heads as
            # [S, B, H_l, D] in memory: that already is the send layout [S, B, W] (destination rows in rank
            # order), so no pack copy.
            send = tensors[idx[0]].transpose(0, 1).reshape(s, b, widths[0])
        else:
            send = _send_buffer((s, b, sum(widths)), dtype, device)
            offset = 0
            for i, w in zip(idx, widths, strict=True):
                t = tensors[i]
                # [B, S, H_l, D] -> [S, B, H_l, D]
                send[..., offset : offset + w].unflatten(-1, (t.shape[2], t.shape[3])).copy_(
                    t.transpose(0, 1)
                )
                offset += w
        recv = torch.empty((world, s_l, b, send.shape[-1]), dtype=dtype, device=device)
        if uneven is None:
            dist.all_to_all_single(recv, send.view(world, s_l, b, send.shape[-1]), group=group)
        else:
            dist.all_to_all_single(
                recv.view(world * s_l, b, send.shape[-1]), send, [s_l] * world, list(uneven), group=group
            )
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
    def forward(ctx, group: dist.ProcessGroup, sizes: Sequence[Sizes], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        return tuple(_seq_to_heads_impl(tensors, group, sizes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, None, *_heads_to_seq_impl(grads, ctx.group, ctx.sizes))


class _HeadsToSeq(torch.autograd.Function):
    """Forward: head-sharded -> sequence-sharded. Backward: the inverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, sizes: Sequence[Sizes], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        return tuple(_heads_to_seq_impl(tensors, group, sizes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, None, *_seq_to_heads_impl(grads, ctx.group, ctx.sizes))


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
    longest = max(sizes) if not _uniform(sizes) else None
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
    longest = s_l if _uniform(sizes) else max(sizes)
    widths = [t.shape[2] * t.shape[3] for t in tensors]
    # uneven: every rank sends `longest` rows (its own, then zeros), the padding is cut out after
    send = torch.zeros((longest, b, sum(widths)), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t, w in zip(tensors, widths, strict=True):
        send[:s_l, :, offset : offset + w].copy_(t.flatten(2).transpose(0, 1))
        offset += w
    recv = torch.empty((world * longest, b, sum(widths)), dtype=send.dtype, device=send.device)
    _all_gather_dim0(recv, send, group)
    if not _uniform(sizes):
        recv = torch.cat([recv[p * longest : p * longest + n] for p, n in enumerate(sizes)])
    out, offset = [], 0
    for t, w in zip(tensors, widths, strict=True):
        out.append(recv[..., offset : offset + w].unflatten(-1, t.shape[2:]).transpose(0, 1))
        offset += w
    return out


class _GatherSeq(torch.autograd.Function):
    """Forward: all-gather along the sequence. Backward: every rank's gradient for my chunk, summed."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, sizes: Sizes, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        ctx.local_len = tensors[0].shape[1]
        return tuple(_gather_seq_impl(tensors, group, sizes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        rank, s_l = dist.get_rank(ctx.group), ctx.local_len
        start = rank * s_l if _uniform(ctx.sizes) else sum(ctx.sizes[:rank])
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
        mine = packed[start : start + s_l]
        out, offset = [], 0
        for g, w in zip(grads, widths, strict=True):
            out.append(mine[..., offset : offset + w].unflatten(-1, g.shape[2:]).transpose(0, 1).contiguous())
            offset += w
        return (None, None, *out)


def gather_seq(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sizes = None
) -> list[torch.Tensor]:
    """All-gather ``[B, S_l, H, D] -> [B, S, H, D]`` along the sequence (rank order), differentiable.

    The ring dimension of Ulysses x Ring with dropout: each rank's queries attend to every rank's keys/values.
    The backward sums every rank's gradient for this rank's chunk. Tensors must share (B, S_l); ``sizes``
    lists every rank's ``S_l`` when they differ.
    """
    if dist.get_world_size(group) == 1:
        return list(tensors)
    shapes = {tuple(t.shape[:2]) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"gather_seq needs one (B, S/R) for all tensors, got {sorted(shapes)}")
    return list(_GatherSeq.apply(group, sizes, *tensors))
