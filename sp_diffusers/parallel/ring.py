"""Ring attention: K/V chunks stream around the ring dimension, partial results merge by log-sum-exp.

The ring half of Ulysses x Ring. After the Ulysses exchange, rank ``r`` of a ring of ``R`` holds the
queries of segment ``r`` and the keys/values of segment ``r`` (``[B, H, S/R, D]``). In ``R`` steps each
rank attends its queries to every segment's K/V while the K/V chunk travels one hop per step, so a rank
never holds more than two K/V chunks: memory O(S/R), unlike an all-gather of K/V.

Forward, step ``s`` (chunk ``j = (r - s) mod R``)::

    o_j, lse_j = attention(q, k_j, v_j, mask[..., chunk j])        # one kernel call, exact per chunk
    lse' = logaddexp(lse, lse_j);  o = o * exp(lse - lse') + o_j * exp(lse_j - lse')

Backward (the flash-attention identity): with the final ``o`` and ``lse``, each chunk's gradients are the
attention backward of that chunk evaluated at the *global* ``o, lse`` (softmax probabilities
``exp(q k_j^T scale + mask - lse)``, ``D = rowsum(do * o)``), so ``dq`` sums over chunks locally and
``dk_j, dv_j`` ride around the ring with their chunk and arrive home after one more hop.

Kernels (``sp_diffusers.parallel.kernels``): on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``, on CUDA the
fused flash / efficient kernels (forward and backward per chunk), all returning the log-sum-exp: no score
matrix. Which keys of a chunk a causal query row sees is integer arithmetic on the segment offsets, so the
ring decides on the host which chunks to skip and which run with the kernel's own causal flag, without
reading a tensor: no host sync per chunk. Communication is point-to-point (``batch_isend_irecv``), started
before each chunk's compute so the transfer overlaps it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .kernels import additive_mask, attention_backward, attention_forward

__all__ = ["ring_attention"]

_NEG_INF = float("-inf")


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) + exp(b))`` whose every element is rounded alike wherever it sits in the tensor.

    ``torch.logaddexp`` on CPU computes the SIMD body and the scalar tail of its loop differently (1 ulp apart),
    so a row's result would depend on its position: a micro-batch shuffled for training would then differ from
    its rollout in the last bit. ``exp`` and ``log1p`` have no such split. ``-inf`` for a row that saw no key."""
    high = torch.maximum(a, b)
    merged = high + torch.log1p(torch.exp(torch.minimum(a, b) - high))
    return torch.where(torch.isneginf(high), high, merged)


def _chunk_mask(
    mask: torch.Tensor | None,
    start: int,
    length: int,
    q_start: int,
    q_len: int,
    is_causal: bool,
    like: torch.Tensor,
) -> tuple[torch.Tensor | None, bool, bool]:
    """``(mask, causal, visible)`` for the K/V chunk holding keys ``[start, start + length)``.

    ``mask`` is the additive ``[b, h, q, k]`` mask over the whole key range (k = 1 broadcasts), sliced to the
    chunk. Causal visibility is decided from the offsets alone (query rows ``[q_start, q_start + q_len)``
    see keys ``<=`` their position): a chunk wholly after the last row is skipped, one wholly before the first
    row is unmasked, the chunk that starts with the rows runs with the kernel's own causal flag (top-left
    aligned), and any other overlap gets an explicit mask (``like``'s dtype and device). No tensor is read on
    the host.
    """
    if mask is not None and mask.shape[-1] != 1:
        mask = mask[..., start : start + length]
    if not is_causal:
        return mask, False, True
    last_row = q_start + q_len - 1
    if start > last_row or length == 0:
        return None, False, False
    if start + length - 1 <= q_start:
        return mask, False, True
    if start == q_start:
        return mask, True, True
    rows = torch.arange(q_start, q_start + q_len, device=like.device)
    cols = torch.arange(start, start + length, device=like.device)
    causal = torch.zeros((q_len, length), dtype=like.dtype, device=like.device)
    causal.masked_fill_(cols[None, :] > rows[:, None], _NEG_INF)
    return causal[None, None] if mask is None else mask + causal, False, True


class _Chunks:
    """Where each ring rank's K/V chunk lies in the global key range (chunks may differ in length)."""

    def __init__(self, sizes: list[int] | None, size: int, kv_len: int) -> None:
        self.sizes = sizes if sizes is not None else [kv_len] * size
        self.starts = [sum(self.sizes[:j]) for j in range(size)]
        self.uneven = sizes is not None and len(set(sizes)) > 1

    def buffer_like(self, t: torch.Tensor, chunk: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An empty ``[2, B, H, len(chunk), D]`` buffer (the next hop's chunk may be another length)."""
        shape = (*t.shape[:3], self.sizes[chunk], t.shape[-1])
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)


class _Ring:
    """Double-buffered neighbour exchange: send to ``r + 1``, receive from ``r - 1`` (ring order)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next_rank, self.prev_rank = (rank + 1) % self.size, (rank - 1) % self.size
        self.next = dist.get_global_rank(group, self.next_rank)
        self.prev = dist.get_global_rank(group, self.prev_rank)

    def start(self, send: torch.Tensor, recv: torch.Tensor, *more: torch.Tensor) -> list:
        """Send ``send`` on and receive ``recv`` (and each further ``(send, recv)`` pair) in one batch."""
        ops = []
        pairs = [(send, recv), *zip(more[::2], more[1::2], strict=True)]
        if torch.compiler.is_compiling():  # dynamo traces no point-to-point op: the shift as an all-to-all
            for out, into in pairs:
                sends = [out.numel() if p == self.next_rank else 0 for p in range(self.size)]
                recvs = [into.numel() if p == self.prev_rank else 0 for p in range(self.size)]
                dist.all_to_all_single(into.view(-1), out.reshape(-1), recvs, sends, group=self.group)
            return []
        for out, into in pairs:
            ops.append(dist.P2POp(dist.isend, out, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, into, self.prev, self.group))
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests: list) -> None:
        for req in requests:
            req.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        is_causal: bool,
        group: dist.ProcessGroup,
        kv_sizes: list[int] | None,
        q_start: int,
        kv_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        q_len, kv_len = q.shape[2], k.shape[2]
        mask = additive_mask(mask, q.dtype)
        # a key mask of this rank's K/V segment travels with it; every segment's is kept for backward (O(S))
        chunk_masks: list[torch.Tensor | None] = [None] * size
        travelling = additive_mask(kv_mask, q.dtype).contiguous() if kv_mask is not None else None
        chunks = _Chunks(kv_sizes, size, kv_len)
        ring = _Ring(group)
        kv = torch.stack([k, v])  # one buffer per hop: [2, B, H, S_kv/R, D]
        spare = torch.empty_like(kv)
        # [B, H, S, D] shape in [S, B, H, D] memory, like SDPA's output for seq_to_heads' queries: the
        # exchange back to sequence shards then sends it without a pack copy
        b, h, _, d = q.shape
        out = torch.zeros((q_len, b, h, d), dtype=torch.float32, device=q.device).permute(1, 2, 0, 3)
        lse = torch.full(q.shape[:3], _NEG_INF, dtype=torch.float32, device=q.device)
        for step in range(size):
            chunk = (rank - step) % size
            if chunks.uneven:
                spare = chunks.buffer_like(kv, (chunk - 1) % size)
            pair: tuple[torch.Tensor, ...] = ()
            if travelling is not None:
                chunk_masks[chunk] = travelling
                incoming = travelling.new_empty((*travelling.shape[:-1], chunks.sizes[(chunk - 1) % size]))
                pair = (travelling, incoming)
            requests = ring.start(kv, spare, *pair) if step < size - 1 else []
            chunk_mask, causal, visible = _chunk_mask(
                mask if travelling is None else travelling,
                0 if travelling is not None else chunks.starts[chunk],
                chunks.sizes[chunk],
                q_start - (chunks.starts[chunk] if travelling is not None else 0),
                q_len,
                is_causal,
                q,
            )
            if visible:
                o_j, lse_j, _ = attention_forward(q, kv[0], kv[1], chunk_mask, scale, causal)
                new_lse = _logaddexp(lse, lse_j)
                # rows that saw no key yet keep lse -inf; exp(-inf - -inf) would be nan, so guard the shift
                shift = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
                out.mul_(torch.exp(lse - shift)[..., None])
                out.add_(o_j.float().mul_(torch.exp(lse_j - shift)[..., None]))
                lse = new_lse
            _Ring.wait(requests)
            kv, spare = spare, kv
            if pair:
                travelling = pair[1]
        # A row that sees no key at all: output 0 (as SDPA's CPU kernels give), lse 0 so backward is finite.
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        out = out.to(q.dtype)
        kept = [m for m in chunk_masks if m is not None]
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []), *kept)
        ctx.has_mask, ctx.scale, ctx.is_causal, ctx.group = mask is not None, scale, is_causal, group
        ctx.kv_sizes, ctx.q_start, ctx.travelled = kv_sizes, q_start, bool(kept)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        chunk_masks = rest[int(ctx.has_mask) :] if ctx.travelled else None
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        q_len, kv_len = q.shape[2], k.shape[2]
        chunks = _Chunks(ctx.kv_sizes, size, kv_len)
        ring = _Ring(group)
        kv, kv_spare = torch.stack([k, v]), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        # dK/dV accumulate in fp32 while they travel: R partial sums, low-precision inputs would lose bits
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        dkv_spare = torch.empty_like(dkv)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for step in range(size):
            chunk = (rank - step) % size
            if chunks.uneven:
                kv_spare = chunks.buffer_like(kv, (chunk - 1) % size)
                dkv_spare = chunks.buffer_like(dkv, (chunk - 1) % size)
            requests = ring.start(kv, kv_spare) if step < size - 1 else []
            if chunk_masks is not None:  # the segment masks kept in forward: nothing travels again
                chunk_mask, causal, visible = _chunk_mask(
                    chunk_masks[chunk],
                    0,
                    chunks.sizes[chunk],
                    ctx.q_start - chunks.starts[chunk],
                    q_len,
                    ctx.is_causal,
                    q,
                )
            else:
                chunk_mask, causal, visible = _chunk_mask(
                    mask, chunks.starts[chunk], chunks.sizes[chunk], ctx.q_start, q_len, ctx.is_causal, q
                )
            if visible:
                dq_j, dk_j, dv_j = attention_backward(
                    dout, q, kv[0], kv[1], out, lse, chunk_mask, ctx.scale, causal
                )
                dq += dq_j
                dkv[0] += dk_j
                dkv[1] += dv_j
            # the accumulated dK/dV follow their chunk one hop; after the last step that hop brings them home
            dkv_requests = ring.start(dkv, dkv_spare)
            _Ring.wait(requests)
            _Ring.wait(dkv_requests)
            kv, kv_spare = kv_spare, kv
            dkv, dkv_spare = dkv_spare, dkv
        return (
            dq.to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    kv_sizes: list[int] | None = None,
    q_start: int | None = None,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's query segment over every rank's K/V segment, streamed around a ring.

    ``query [B, H, S_q/R, D]``, ``key/value [B, H, S_kv/R, D]`` (same heads: expand GQA first) ->
    ``[B, H, S_q/R, D]``. ``attn_mask`` is SDPA-shaped ``[b, h, S_q/R, S_kv]`` over the *whole* key range
    (a key dim of 1 broadcasts); ``is_causal`` aligns global query ``i`` with global key ``i`` (segments in
    ring-rank order). Gradients flow to query, key and value, not to the mask. No dropout.

    Segments may differ in length: ``kv_sizes`` lists every ring rank's K/V length (None: all equal) and
    ``q_start`` is the global position of this rank's first query (default ``rank * S_q/R``).

    ``kv_mask`` (instead of ``attn_mask``): a key mask ``[b, 1, 1, S_kv/R]`` of this rank's own K/V segment
    (bool or additive), which travels around the ring with its segment - no mask is gathered.
    """
    if kv_mask is not None and attn_mask is not None:
        raise ValueError(
            "ring_attention takes attn_mask (over every key) or kv_mask (this segment's), not both"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"ring_attention needs key and value of one shape (they travel as one buffer), got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[1] != query.shape[1]:
        raise ValueError(
            f"ring_attention needs as many K/V heads as query heads (got {key.shape[1]} vs {query.shape[1]}); "
            "expand K/V first (repeat_interleave on the head dim)"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if q_start is None:
        q_start = dist.get_rank(group) * query.shape[2]
    return _RingAttention.apply(
        query, key, value, attn_mask, float(scale), bool(is_causal), group, kv_sizes, int(q_start), kv_mask
    )
