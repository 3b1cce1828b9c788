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

Kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its backward) returns the
log-sum-exp; elsewhere a plain-math kernel (fp32 scores, O(S_q/R x S_kv/R) per chunk) keeps the result
exact on any device. Communication is point-to-point (``batch_isend_irecv``), started before each
chunk's compute so the transfer overlaps it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["ring_attention"]

_NEG_INF = float("-inf")


def _chunk_mask(
    mask: torch.Tensor | None,
    start: int,
    length: int,
    causal_rows: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, bool]:
    """The additive mask of the K/V chunk holding keys ``[start, start + length)`` (``None`` = attend to all)
    and whether anything is visible.

    ``mask`` is ``[b, h, q, k]`` over the whole key range (k = 1 broadcasts); bool masks become additive
    because the CPU flash kernel takes masks of the query's dtype.
    """
    if mask is not None and mask.shape[-1] != 1:
        mask = mask[..., start : start + length]
    if causal_rows is not None:
        cols = torch.arange(start, start + length, device=causal_rows.device)
        allowed = cols[None, :] <= causal_rows[:, None]  # [q, k]
        if not bool(allowed.any()):
            return None, False
        if bool(allowed.all()):
            return None, True
        mask = allowed[None, None]
    if mask is None:
        return None, True
    if mask.dtype == torch.bool:
        if not bool(mask.any()):
            return None, False
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, _NEG_INF)
    else:
        mask = mask.to(dtype)
    return mask, True


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


def _use_cpu_flash(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _kernel_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, q, D] x [B, H, k, D] -> (out [B, H, q, D], lse [B, H, q] fp32)``; fully masked rows: lse -inf."""
    if _use_cpu_flash(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale
        )
        lse = lse.float()
        if mask is not None:
            # The CPU kernel reports lse 0 (not -inf) for a row whose keys are all masked; in a merge that
            # would count as mass, so mark such rows empty.
            empty = torch.isneginf(mask).all(-1)  # [b, h, q] broadcast to lse
            if bool(empty.any()):
                lse = lse.masked_fill(empty.expand_as(lse), _NEG_INF)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def _kernel_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one chunk at the global ``out``/``lse`` (rows with lse -inf must carry lse 0 here)."""
    if _use_cpu_flash(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
        )
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    probs = torch.exp(scores - lse[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), dof)
    dprobs = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kf)
    dk = torch.matmul(dscores.transpose(-1, -2), qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Ring:
    """Double-buffered neighbour exchange: send to ``r + 1``, receive from ``r - 1`` (ring order)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
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
    ) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        q_len, kv_len = q.shape[2], k.shape[2]
        causal_rows = torch.arange(q_len, device=q.device) + q_start if is_causal else None
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
            requests = ring.start(kv, spare) if step < size - 1 else []
            chunk_mask, visible = _chunk_mask(
                mask, chunks.starts[chunk], chunks.sizes[chunk], causal_rows, q.dtype
            )
            if visible:
                o_j, lse_j = _kernel_forward(q, kv[0], kv[1], chunk_mask, scale)
                new_lse = torch.logaddexp(lse, lse_j)
                # rows that saw no key yet keep lse -inf; exp(-inf - -inf) would be nan, so guard the shift
                shift = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
                out.mul_(torch.exp(lse - shift)[..., None])
                out.add_(o_j.float().mul_(torch.exp(lse_j - shift)[..., None]))
                lse = new_lse
            _Ring.wait(requests)
            kv, spare = spare, kv
        # A row that sees no key at all: output 0 (as SDPA's CPU kernels give), lse 0 so backward is finite.
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.has_mask, ctx.scale, ctx.is_causal, ctx.group = mask is not None, scale, is_causal, group
        ctx.kv_sizes, ctx.q_start = kv_sizes, q_start
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        q_len, kv_len = q.shape[2], k.shape[2]
        causal_rows = torch.arange(q_len, device=q.device) + ctx.q_start if ctx.is_causal else None
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
            chunk_mask, visible = _chunk_mask(
                mask, chunks.starts[chunk], chunks.sizes[chunk], causal_rows, q.dtype
            )
            if visible:
                dq_j, dk_j, dv_j = _kernel_backward(dout, q, kv[0], kv[1], out, lse, chunk_mask, ctx.scale)
                dq += dq_j
                dkv[0] += dk_j
                dkv[1] += dv_j
            # the accumulated dK/dV follow their chunk one hop; after the last step that hop brings them home
            dkv_requests = ring.start(dkv, dkv_spare)
            _Ring.wait(requests)
            _Ring.wait(dkv_requests)
            kv, kv_spare = kv_spare, kv
            dkv, dkv_spare = dkv_spare, dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


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
) -> torch.Tensor:
    """Exact attention of this rank's query segment over every rank's K/V segment, streamed around a ring.

    ``query [B, H, S_q/R, D]``, ``key/value [B, H, S_kv/R, D]`` (same heads: expand GQA first) ->
    ``[B, H, S_q/R, D]``. ``attn_mask`` is SDPA-shaped ``[b, h, S_q/R, S_kv]`` over the *whole* key range
    (a key dim of 1 broadcasts); ``is_causal`` aligns global query ``i`` with global key ``i`` (segments in
    ring-rank order). Gradients flow to query, key and value, not to the mask. No dropout.

    Segments may differ in length: ``kv_sizes`` lists every ring rank's K/V length (None: all equal) and
    ``q_start`` is the global position of this rank's first query (default ``rank * S_q/R``).
    """
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
        query, key, value, attn_mask, float(scale), bool(is_causal), group, kv_sizes, int(q_start)
    )
