"""Attention kernels that return the log-sum-exp, chosen per device: nothing here builds a score matrix on
CPU or CUDA.

Every function takes ``[B, H, S, D]`` tensors (any strides with a contiguous last dim) and an optional
additive mask of the query's dtype, broadcastable to ``[B, H, S_q, S_kv]``; each returns the output and the
log-sum-exp ``[B, H, S_q]`` in fp32, which the ring merges and which the backward takes back (the backward
of one K/V chunk is evaluated at the *global* output and log-sum-exp: the flash-attention identity).

Kernels (aten's own, forward and backward):

    device       dtype            mask     kernel
    cpu          any              any      _scaled_dot_product_flash_attention_for_cpu
    cuda / meta  fp16, bf16       none     _scaled_dot_product_flash_attention
    cuda / meta  fp32/fp16/bf16   any      _scaled_dot_product_efficient_attention (the mask is its bias)
    other        (fp64, mps, ...) any      plain math in fp32 (the one path with a score matrix: no fused
                                           kernel takes these)

``meta`` stands in for CUDA: tracing a model on meta tensors (the CI canary, the planner's memory estimates)
runs exactly the calls a GPU would. Flash takes no mask, the efficient kernel takes an additive bias, so a
masked call always runs the efficient kernel. Head dims are zero-padded to a multiple of 8 (both fused
kernels need it; zero columns change no dot product and are sliced off), K/V heads are expanded for GQA,
and the bias is laid out as aten's SDPA lays it out for the efficient kernel (16-byte aligned rows,
expanded to 4-D). A row whose keys are all masked reports log-sum-exp -inf and output 0 on every kernel
(the CPU kernel itself reports 0 for such rows).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "FUSED_OPS",
    "FusedAttention",
    "additive_mask",
    "attention_backward",
    "attention_forward",
    "fused_attention",
    "kernel_for",
]

aten = torch.ops.aten
_NEG_INF = float("-inf")
_HALF = (torch.float16, torch.bfloat16)

# the aten ops a fused path may run (forward and backward); the CI canary holds attention to these
FUSED_OPS = frozenset(
    {
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_backward.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_efficient_attention_backward.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_cudnn_attention_backward.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    }
)


def kernel_for(q: torch.Tensor, has_mask: bool) -> str:
    """``"cpu_flash"``, ``"flash"``, ``"efficient"`` or ``"math"`` for a call on ``q`` (see the table above)."""
    device = q.device.type
    if device == "cpu":
        return "cpu_flash"
    if device in ("cuda", "meta") and q.dtype in (torch.float32, *_HALF):
        if not has_mask and q.dtype in _HALF and q.shape[-1] <= 256:
            return "flash"
        return "efficient"
    return "math"


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = attend) as the additive mask the kernels take (0 / -inf), or a float mask cast."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, _NEG_INF)
    return mask.to(dtype)


def _pad_head_dim(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = tensors[0].shape[-1]
    if d % 8 == 0:
        return tensors
    return tuple(F.pad(t, (0, 8 - d % 8)) for t in tensors)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bias_for_efficient(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """aten's layout of an efficient-attention bias: every row 16-byte aligned, expanded to ``[B, H, S_q, S_kv]``."""
    if mask.shape[-1] == 1 and k.shape[2] != 1:
        # a mask over query rows only (every key alike): the kernel reads bias rows along the keys, so they
        # are materialised; key-padding masks, the common case, never take this path
        mask = mask.expand(*mask.shape[:-1], k.shape[2]).contiguous()
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        n = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _empty_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[b, h, q]`` True where every key of a row is masked (None without a mask)."""
    return None if mask is None else torch.isneginf(mask).all(-1)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(out [B, H, S_q, D], lse [B, H, S_q] fp32 (fp64 for fp64 inputs), state)``; ``state`` is what :func:`attention_backward` needs
    back besides the tensors (the dropout RNG of the fused kernels). ``mask`` is additive (see
    :func:`additive_mask`). K/V may have fewer heads (GQA); dropout runs on the fused kernels only."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    kind = kernel_for(q, mask is not None)
    d = q.shape[-1]
    if kind == "cpu_flash":
        if dropout_p:
            raise ValueError("attention_forward: dropout runs on the fused CUDA kernels, not on CPU")
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        state: Any = None
        lse = lse.float()
    elif kind == "flash":
        qp, kp, vp = (_last_dim_contiguous(t) for t in _pad_head_dim(q, k, v))
        res = aten._scaled_dot_product_flash_attention(qp, kp, vp, dropout_p, is_causal, False, scale=scale)
        out, lse = res[0], res[1]
        state = ("flash", res[2], res[3], res[4], res[5], res[6], res[7])
    elif kind == "efficient":
        qp, kp, vp = (_last_dim_contiguous(t) for t in _pad_head_dim(q, k, v))
        bias = _bias_for_efficient(mask, qp, kp) if mask is not None else None
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            qp, kp, vp, bias, True, dropout_p, is_causal, scale=scale
        )
        lse = lse[..., : q.shape[2]]  # the kernel pads the rows to a multiple of 32
        state = ("efficient", seed, offset)
    else:
        if dropout_p:
            raise ValueError(f"attention_forward: no dropout kernel for {q.dtype} on {q.device.type}")
        out, lse = _math_forward(q, k, v, mask, scale, is_causal)
        state = None
    if out.shape[-1] != d:
        out = out[..., :d]
    empty = _empty_rows(mask)
    if empty is not None:
        lse = lse.masked_fill(empty.expand_as(lse), _NEG_INF)
        out = out.masked_fill(empty.expand(out.shape[:3])[..., None], 0.0)
    return out, lse, state


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    state: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one call at ``out``/``lse`` (global ones for a ring chunk; rows of lse -inf must
    carry 0 here). ``dk``/``dv`` have ``k``'s heads (GQA groups summed)."""
    kv_heads = k.shape[1]
    if kv_heads != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // kv_heads, dim=1) for t in (k, v))
    kind = kernel_for(q, mask is not None)
    d = q.shape[-1]
    if kind == "cpu_flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    elif kind in ("flash", "efficient"):
        qp, kp, vp, op, dop = (_last_dim_contiguous(t) for t in _pad_head_dim(q, k, v, out, dout))
        if kind == "flash":
            _, cum_q, cum_k, max_q, max_k, seed, offset = state or (
                "flash",
                None,
                None,
                q.shape[2],
                k.shape[2],
                None,
                None,
            )
            if seed is None:  # a chunk whose forward ran elsewhere (the ring): no dropout, no RNG state
                seed = torch.empty((2,), dtype=torch.uint64, device=q.device)
                offset = torch.empty((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dop,
                qp,
                kp,
                vp,
                op,
                lse.contiguous(),
                cum_q,
                cum_k,
                max_q,
                max_k,
                dropout_p,
                is_causal,
                seed,
                offset,
                scale=scale,
            )
        else:
            _, seed, offset = state or ("efficient", None, None)
            if seed is None:
                seed = torch.empty((), dtype=torch.long, device=q.device)
                offset = torch.empty((), dtype=torch.long, device=q.device)
            rows = q.shape[2]
            lse_p = F.pad(lse, (0, -rows % 32)).contiguous()  # the kernel's own row padding
            bias = _bias_for_efficient(mask, qp, kp) if mask is not None else None
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                dop,
                qp,
                kp,
                vp,
                bias,
                op,
                lse_p,
                seed,
                offset,
                dropout_p,
                [True, True, True, False],
                is_causal,
                scale=scale,
            )
        if dq.shape[-1] != d:
            dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
    else:
        dq, dk, dv = _math_backward(dout, q, k, v, out, lse, mask, scale, is_causal)
    if kv_heads != q.shape[1]:
        group = q.shape[1] // kv_heads
        dk, dv = (t.unflatten(1, (kv_heads, group)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _causal_bias(q_len: int, k_len: int, like: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(q_len, device=like.device)[:, None]
    cols = torch.arange(k_len, device=like.device)[None, :]
    return torch.zeros((q_len, k_len), dtype=like.dtype, device=like.device).masked_fill_(
        cols > rows, _NEG_INF
    )


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 scores, fp64 for fp64 inputs


def _math_forward(q, k, v, mask, scale, is_causal):
    acc = _acc(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.to(acc)
    if is_causal:
        scores = scores + _causal_bias(q.shape[2], k.shape[2], scores)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.matmul(probs, v.to(acc)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, mask, scale, is_causal):
    acc = _acc(q.dtype)
    qf, kf, vf, dof = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.to(acc)
    if is_causal:
        scores = scores + _causal_bias(q.shape[2], k.shape[2], scores)
    probs = torch.exp(scores - lse.to(acc)[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), dof)
    dprobs = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.to(acc)).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    return (
        torch.matmul(dscores, kf).to(q.dtype),
        torch.matmul(dscores.transpose(-1, -2), qf).to(k.dtype),
        dv.to(v.dtype),
    )


class FusedAttention(torch.autograd.Function):
    """One attention call through :func:`attention_forward`, its backward through :func:`attention_backward`
    (no recomputation). Inputs ``[B, H, S, D]``; the mask (additive) gets no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, is_causal, dropout_p):  # type: ignore[override]
        out, lse, state = attention_forward(q, k, v, mask, scale, is_causal, dropout_p)
        # a row that sees no key: output 0 (as above), lse 0 so that its backward is finite (and zero)
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.scale, ctx.is_causal, ctx.dropout_p, ctx.state = scale, is_causal, dropout_p, state
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if rest else None
        dq, dk, dv = attention_backward(
            dout, q, k, v, out, lse, mask, ctx.scale, ctx.is_causal, ctx.dropout_p, ctx.state
        )
        return dq, dk, dv, None, None, None, None


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA on ``[B, H, S, D]`` through the fused kernels (differentiable); ``mask`` bool or additive."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return FusedAttention.apply(
        q, k, v, additive_mask(mask, q.dtype), float(scale), bool(is_causal), float(dropout_p)
    )
