"""The all-to-alls of Ulysses sequence parallelism: differentiable, one collective per call.

Glossary (used in every shape comment of this package):
    B   batch                     S   global sequence length     S_l = S / P, the local sequence length
    H   heads (query or K/V)      D   head dim                   H_l = H / P, the local heads
    P   Ulysses degree (size of the process group)

:func:`seq_to_heads` and :func:`heads_to_seq` pack every tensor of one call into a single
``all_to_all_single``, queries and K/V of different lengths (cross-attention) included: a collective costs
~1 ms of latency on gloo and a launch and a synchronisation point on NCCL, more than the layout work it saves.
Each is an autograd function whose backward is the other direction; a tensor that needs no gradient (a key mask
riding along with K/V) gets none back in the backward exchange.

The send buffer of ``seq -> heads`` is laid out ``[P, S_l, B, W]`` (W = the concatenated ``H_l * D`` of the
packed tensors), destination rank first, so that the receive buffer reads as ``[S, B, W]`` without a copy
(source rank and ``S_l`` are adjacent): the received tensors are strided views, one layout copy in total on
the way in. ``heads -> seq`` sends ``[S, B, W]`` rows (the received queries' layout: an output a kernel
writes in it needs no pack) and interleaves each source's heads on the way out: one copy. Where this rank's own block can be left out of
the collective (:func:`_others`) it is copied straight to its place instead.

Nothing here knows about attention, models or training.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .gathers import Sizes
from .gathers import uniform as _uniform

__all__ = ["heads_to_seq", "release_buffers", "seq_to_heads", "split_sizes", "to_all_to_all_order"]

# Send buffers are reused on CPU: a fresh multi-MB buffer page-faults on its first write, which costs more than
# the all-to-all itself on gloo (docs/benchmarks.md). A send buffer is free again as soon as the (synchronous)
# collective returns. CUDA's caching allocator already recycles memory, so there every buffer is a torch.empty.
_SEND_BUFFERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _send_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu" or torch.compiler.is_compiling():  # a compiled graph plans its own buffers
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


def _buckets(tensors: Sequence[torch.Tensor], sizes: Sequence[Sizes]) -> dict[tuple, list[int]]:
    """Tensors sharing (B, S_l, sizes, dtype, device) travel as one block of the send buffer."""
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        key = (t.shape[0], t.shape[1], None if _uniform(sizes[i]) else tuple(sizes[i]), t.dtype, t.device)
        buckets.setdefault(key, []).append(i)
    return buckets


def _others(rank: int, world: int) -> slice | None:
    """The other ranks as one slice of the rank order, where they make one (this rank first or last: always at
    P = 2), else None.

    Then this rank's own block of an exchange is copied straight to its place and the collective carries only
    the others' blocks: an all-to-all copies a rank's own block through its buffers (gloo: a memcpy after the
    transfers; 2 of 7.6 ms for 12 MiB at P = 2), and every layout copy of the exchange is still made once."""
    if rank == 0:
        return slice(1, world)
    if rank == world - 1:
        return slice(0, world - 1)
    return None


def _all_to_all_blocks(recv: torch.Tensor, send: torch.Tensor, world: int, rank: int, group) -> None:
    """``all_to_all_single`` of one block per peer (dim 0 of ``send``/``recv``: the ``P - 1`` other ranks in
    rank order), none to or from this rank itself."""
    splits = [0 if p == rank else 1 for p in range(world)]
    dist.all_to_all_single(recv, send, splits, splits, group=group)


def _pack_seq(
    send: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    idx: list[int],
    world: int,
    dests: slice = slice(None),
) -> None:
    """``send`` ``[len(dests), S_l, B, W]`` <- the tensors ``idx`` (``[B, S_l, H, D]``), the heads of each
    destination of ``dests`` at its index."""
    offset = 0
    for i in idx:
        t = tensors[i]
        h_l, d = t.shape[2] // world, t.shape[3]
        # [B, S_l, P, H_l, D] -> [P, S_l, B, H_l, D]: the only layout copy of this direction.
        send[..., offset : offset + h_l * d].unflatten(-1, (h_l, d)).copy_(
            t.unflatten(2, (world, h_l))[:, :, dests].permute(2, 1, 0, 3, 4)
        )
        offset += h_l * d


def _unpack_heads(
    recv: torch.Tensor, tensors: Sequence[torch.Tensor], idx: list[int], world: int, out: list
) -> None:
    """``recv`` ``[S, B, W]`` -> each tensor ``[B, S, H_l, D]`` as a strided view."""
    offset = 0
    for i in idx:
        h_l, d = tensors[i].shape[2] // world, tensors[i].shape[3]
        out[i] = recv[..., offset : offset + h_l * d].unflatten(-1, (h_l, d)).transpose(0, 1)
        offset += h_l * d


def _seq_to_heads_impl(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sequence[Sizes]
) -> list[torch.Tensor]:
    """``[B, S_l, H, D] -> [B, S, H/P, D]`` for each tensor, in one collective per dtype.

    Every destination gets all of this rank's ``S_l`` rows (of its own heads), so the send splits are equal;
    from source ``p`` arrive ``sizes[p]`` rows, which the receive splits carry. Tensors of different lengths
    (cross-attention: queries and K/V) share the collective through a flat buffer whose per-rank blocks
    hold one piece of each length; their receive side costs one more copy.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[tuple, dict[tuple, list[int]]] = {}
    for key, idx in _buckets(tensors, sizes).items():
        by_dtype.setdefault(key[3:], {})[key] = idx
    for (dtype, device), buckets in by_dtype.items():
        if len(buckets) == 1:
            (((b, s_l, uneven, _, _), idx),) = buckets.items()
            width = sum(tensors[i].shape[2] // world * tensors[i].shape[3] for i in idx)
            others = _others(rank, world) if uneven is None else None
            if others is not None:
                recv = torch.empty((world, s_l, b, width), dtype=dtype, device=device)
                _pack_seq(recv[rank : rank + 1], tensors, idx, world, slice(rank, rank + 1))
                send = _send_buffer((world - 1, s_l, b, width), dtype, device)
                _pack_seq(send, tensors, idx, world, others)
                _all_to_all_blocks(recv[others], send, world, rank, group)
                recv = recv.view(world * s_l, b, width)  # [P, S_l, B, W] -> [S, B, W], free
            elif uneven is None:
                send = _send_buffer((world, s_l, b, width), dtype, device)
                _pack_seq(send, tensors, idx, world)
                recv = torch.empty_like(send)
                dist.all_to_all_single(recv, send, group=group)
                recv = recv.view(world * s_l, b, width)
            else:
                send = _send_buffer((world, s_l, b, width), dtype, device)
                _pack_seq(send, tensors, idx, world)
                # [S, B, W] with source p's rows at its offset: the same free view, split sizes per source
                recv = torch.empty((sum(uneven), b, width), dtype=dtype, device=device)
                dist.all_to_all_single(
                    recv, send.view(world * s_l, b, width), list(uneven), [s_l] * world, group=group
                )
            _unpack_heads(recv, tensors, idx, world, out)
            continue
        # several lengths: per destination one block [piece of bucket 0 | piece of bucket 1 | ...]
        shapes = []  # (idx, b, s_l, every rank's length, width)
        for (b, s_l, uneven, _, _), idx in buckets.items():
            width = sum(tensors[i].shape[2] // world * tensors[i].shape[3] for i in idx)
            shapes.append((idx, b, s_l, list(uneven) if uneven is not None else [s_l] * world, width))
        block = sum(b * s_l * w for _, b, s_l, _, w in shapes)
        send = _send_buffer((world, block), dtype, device)
        offset = 0
        for idx, b, s_l, _, w in shapes:
            _pack_seq(send[:, offset : offset + b * s_l * w].view(world, s_l, b, w), tensors, idx, world)
            offset += b * s_l * w
        from_source = [sum(b * n[p] * w for _, b, _, n, w in shapes) for p in range(world)]
        recv = torch.empty(sum(from_source), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send.view(-1), from_source, [block] * world, group=group)
        pieces = recv.split(from_source)
        starts = [0] * world  # where the next bucket's piece begins in each source's block
        for idx, b, _, n, w in shapes:
            rows = []
            for p, piece in enumerate(pieces):
                rows.append(piece[starts[p] : starts[p] + b * n[p] * w].view(n[p], b, w))
                starts[p] += b * n[p] * w
            _unpack_heads(torch.cat(rows), tensors, idx, world, out)
    return out  # type: ignore[return-value]


def _pack_rows(
    send: torch.Tensor, tensors: Sequence[torch.Tensor], idx: list[int], rows: slice = slice(None)
) -> None:
    """``send`` ``[len(rows), B, W]`` <- ``rows`` of the tensors ``idx`` (``[B, S, H_l, D]``)."""
    offset = 0
    for i in idx:
        t = tensors[i]
        w = t.shape[2] * t.shape[3]
        send[..., offset : offset + w].unflatten(-1, (t.shape[2], t.shape[3])).copy_(
            t[:, rows].transpose(0, 1)
        )
        offset += w


def _heads_to_seq_others(
    tensors: Sequence[torch.Tensor], idx: list[int], group, world: int, rank: int, others: slice, out: list
) -> None:
    """The even exchange ``[B, S, H_l, D] -> [B, S_l, H, D]`` of the tensors ``idx`` where the other ranks
    make one slice of the rank order (:func:`_others`): this rank's own rows are copied straight from the
    tensors into its heads of the result, the collective carries only the others' rows."""
    b, s = tensors[idx[0]].shape[:2]
    s_l, width = s // world, sum(tensors[i].shape[2] * tensors[i].shape[3] for i in idx)
    rows = slice(others.start * s_l, others.stop * s_l)
    if len(idx) == 1 and tensors[idx[0]].transpose(0, 1).is_contiguous():
        send = tensors[idx[0]].transpose(0, 1).reshape(s, b, width)[rows]  # already [S, B, W]: no pack copy
    else:
        send = _send_buffer(((world - 1) * s_l, b, width), tensors[idx[0]].dtype, tensors[idx[0]].device)
        _pack_rows(send, tensors, idx, rows)
    recv = torch.empty((world - 1, s_l, b, width), dtype=send.dtype, device=send.device)
    _all_to_all_blocks(recv, send.view(world - 1, s_l, b, width), world, rank, group)
    own = slice(rank * s_l, (rank + 1) * s_l)
    offset = 0
    for i in idx:
        t = tensors[i]
        h_l, d = t.shape[2], t.shape[3]
        result = torch.empty((b, s_l, world, h_l, d), dtype=t.dtype, device=t.device)
        result[:, :, rank].copy_(t[:, own])
        result[:, :, others].copy_(
            recv[..., offset : offset + h_l * d].unflatten(-1, (h_l, d)).permute(2, 1, 0, 3, 4)
        )
        out[i] = result.view(b, s_l, world * h_l, d)
        offset += h_l * d


def _unpack_seq(
    recv: torch.Tensor, tensors: Sequence[torch.Tensor], idx: list[int], world: int, out: list
) -> None:
    """``recv`` ``[P, S_l, B, W]`` -> each tensor ``[B, S_l, H_l * P, D]``: heads of source rank p land at
    ``p * H_l``, the head order of the unsharded tensor. The reshape is the receive copy."""
    b, s_l = recv.shape[2], recv.shape[1]
    offset = 0
    for i in idx:
        h_l, d = tensors[i].shape[2], tensors[i].shape[3]
        out[i] = (
            recv[..., offset : offset + h_l * d]
            .unflatten(-1, (h_l, d))
            .permute(2, 1, 0, 3, 4)
            .reshape(b, s_l, world * h_l, d)
        )
        offset += h_l * d


def _heads_to_seq_impl(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, sizes: Sequence[Sizes]
) -> list[torch.Tensor]:
    """``[B, S, H_l, D] -> [B, S_l, H_l * P, D]`` for each tensor; the exact inverse of ``_seq_to_heads_impl``,
    one collective per dtype.

    Destination ``p`` gets rows ``[offset_p, offset_p + sizes[p])``; from every source arrive this rank's
    ``S_l`` rows (of the source's heads): equal receive splits.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[tuple, dict[tuple, list[int]]] = {}
    for key, idx in _buckets(tensors, sizes).items():
        by_dtype.setdefault(key[3:], {})[key] = idx
    for (dtype, device), buckets in by_dtype.items():
        if len(buckets) == 1:
            (((b, s, uneven, _, _), idx),) = buckets.items()
            others = _others(rank, world) if uneven is None else None
            if others is not None:
                _heads_to_seq_others(tensors, idx, group, world, rank, others, out)
                continue
            s_l = s // world if uneven is None else uneven[rank]
            width = sum(tensors[i].shape[2] * tensors[i].shape[3] for i in idx)
            if len(idx) == 1 and tensors[idx[0]].transpose(0, 1).is_contiguous():
                # a kernel that writes its output in the query's layout, for queries straight out of
                # seq_to_heads ([S, B, H_l, D] in memory), leaves it in the send layout [S, B, W] already
                # (destination rows in rank order): no pack copy.
                send = tensors[idx[0]].transpose(0, 1).reshape(s, b, width)
            else:
                send = _send_buffer((s, b, width), dtype, device)
                _pack_rows(send, tensors, idx)
            recv = torch.empty((world, s_l, b, width), dtype=dtype, device=device)
            if uneven is None:
                dist.all_to_all_single(recv, send.view(world, s_l, b, width), group=group)
            else:
                dist.all_to_all_single(
                    recv.view(world * s_l, b, width), send, [s_l] * world, list(uneven), group=group
                )
            _unpack_seq(recv, tensors, idx, world, out)
            continue
        # several lengths: the block for destination p holds its rows of bucket 0, then of bucket 1, ...
        shapes = []  # (idx, b, every rank's length, width)
        for (b, s, uneven, _, _), idx in buckets.items():
            width = sum(tensors[i].shape[2] * tensors[i].shape[3] for i in idx)
            shapes.append((idx, b, list(uneven) if uneven is not None else [s // world] * world, width))
        to_dest = [sum(b * n[p] * w for _, b, n, w in shapes) for p in range(world)]
        send = _send_buffer((sum(to_dest),), dtype, device)
        blocks = send.split(to_dest)
        starts = [0] * world
        for idx, b, n, w in shapes:
            rows = torch.empty((sum(n), b, w), dtype=dtype, device=device)
            _pack_rows(rows, tensors, idx)
            for p, part in enumerate(rows.split(n)):
                blocks[p][starts[p] : starts[p] + part.numel()].view_as(part).copy_(part)
                starts[p] += part.numel()
        block = sum(b * n[rank] * w for _, b, n, w in shapes)
        recv = torch.empty((world, block), dtype=dtype, device=device)
        dist.all_to_all_single(recv.view(-1), send, [block] * world, to_dest, group=group)
        offset = 0
        for idx, b, n, w in shapes:
            piece = recv[:, offset : offset + b * n[rank] * w].view(world, n[rank], b, w)
            _unpack_seq(piece, tensors, idx, world, out)
            offset += b * n[rank] * w
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------ the autograd functions


def split_sizes(total: int, world: int) -> list[int]:
    """How a length ``total`` is split over ``world`` ranks: ``torch.tensor_split``'s rule (the first
    ``total % world`` ranks hold one more), which diffusers' uneven sharding and sp-diffusers' share."""
    return [total // world + (r < total % world) for r in range(world)]


class _Exchange(torch.autograd.Function):
    """Forward: ``impl`` (one direction of the exchange). Backward: ``inverse`` of the gradients of the inputs
    that need one (a mask riding along gets None)."""

    @staticmethod
    def forward(ctx, impl, inverse, group: dist.ProcessGroup, sizes: Sequence[Sizes], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.inverse, ctx.group, ctx.sizes = inverse, group, sizes
        out = tuple(impl(tensors, group, sizes))
        ctx.mark_non_differentiable(*(o for o, t in zip(out, tensors, strict=True) if not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        needed = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        result: list[torch.Tensor | None] = [None] * len(grads)
        if needed:
            exchanged = ctx.inverse([grads[i] for i in needed], ctx.group, [ctx.sizes[i] for i in needed])
            for i, g in zip(needed, exchanged, strict=True):
                result[i] = g
        return (None, None, None, None, *result)


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
    return list(_Exchange.apply(_seq_to_heads_impl, _heads_to_seq_impl, group, sizes, *tensors))


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
    return list(_Exchange.apply(_heads_to_seq_impl, _seq_to_heads_impl, group, sizes, *tensors))


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
