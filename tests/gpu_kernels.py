"""The kernel layer against an fp64 reference on a real device - for a machine with a GPU.

    python -m tests.gpu_kernels --device cuda      # one JSON line per check; exit code 1 if one fails

What CPU CI cannot run: the fused CUDA kernels' calling conventions (their log-sum-exp layout, the efficient
kernel's row padding and bias alignment, the flash backward's RNG arguments). Each check compares, against
SDPA in fp64 on the CPU:

- ``oneshot``: ``kernels.fused_attention`` forward and backward (what the Ulysses path runs on CUDA);
- ``chunked``: the ring's use of the kernels in one process - K/V cut into chunks, outputs merged by
  log-sum-exp, each chunk's backward evaluated at the merged output and log-sum-exp - forward and backward.

Cases: bf16 and fp32; no mask, a key-padding mask, a full mask with a row that sees no key, causal; GQA; a
head dim that is not a multiple of 8. Tolerances are the dtype's resolution on O(1) values: bf16 3e-2 (outputs)
and 1e-1 (gradients summing 256 terms), fp32 1e-4 / 1e-3 (the efficient kernel's fp32 accumulation order).
``tests/test_kernels.py`` runs the same checks on the CPU kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from sp_diffusers.parallel import kernels

TOLERANCE = {torch.bfloat16: (3e-2, 1e-1), torch.float32: (1e-4, 1e-3), torch.float64: (1e-10, 1e-9)}


def _case_tensors(dtype, device, heads=4, kv_heads=4, s=256, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, s, d, generator=g, dtype=torch.float64)
    dout = torch.randn(2, heads, s, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)], [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _mask(kind: str, s: int, device) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(3)
    if kind == "key_padding":
        m = torch.rand(2, 1, 1, s, generator=g) > 0.3
    elif kind == "full_with_empty_row":
        m = torch.rand(2, 1, s, s, generator=g) > 0.5
        m[:, :, 5] = False
    else:
        return None
    return m.to(device)


def _reference(q, k, v, dout, mask, causal):
    ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in ins[1:])
    out = F.scaled_dot_product_attention(ins[0], kk, vv, attn_mask=mask, is_causal=causal)
    out = torch.nan_to_num(out)  # a row with no key: 0, as the kernels give
    out.backward(dout.double())
    return out.detach(), [t.grad for t in ins]


def _chunked(q, k, v, dout, mask, causal, chunks=2):
    """The ring's arithmetic in one process (no causal here: the ring's causal chunks are offsets, tested on CPU)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    add = kernels.additive_mask(mask, q.dtype)
    pieces = list(zip(k.chunk(chunks, dim=2), v.chunk(chunks, dim=2), strict=True))
    width = pieces[0][0].shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for j, (kj, vj) in enumerate(pieces):
        mj = None if add is None else add[..., j * width : (j + 1) * width]
        o_j, lse_j, _ = kernels.attention_forward(q, kj, vj, mj, scale)
        new = torch.logaddexp(lse, lse_j)
        shift = torch.where(torch.isneginf(new), 0.0, new)
        out = out * torch.exp(lse - shift)[..., None] + o_j.float() * torch.exp(lse_j - shift)[..., None]
        lse = new
    lse = torch.where(torch.isneginf(lse), 0.0, lse)
    out = out.to(q.dtype)
    grads = [torch.zeros_like(q, dtype=torch.float32)]
    dk, dv = [], []
    for j, (kj, vj) in enumerate(pieces):
        mj = None if add is None else add[..., j * width : (j + 1) * width]
        dq_j, dk_j, dv_j = kernels.attention_backward(dout, q, kj, vj, out, lse, mj, scale)
        grads[0] += dq_j.float()
        dk.append(dk_j)
        dv.append(dv_j)
    return out, [grads[0].to(q.dtype), torch.cat(dk, dim=2), torch.cat(dv, dim=2)]


def run(device: str) -> list[dict]:
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for mask_kind in ("none", "key_padding", "full_with_empty_row", "causal"):
            for kv_heads, d in ((4, 64), (2, 64), (4, 100)):
                (q, k, v, dout), (qd, kd, vd, doutd) = _case_tensors(dtype, device, kv_heads=kv_heads, d=d)
                causal = mask_kind == "causal"
                mask_d = _mask(mask_kind, q.shape[2], device)
                ref, ref_grads = _reference(q, k, v, dout, None if mask_d is None else mask_d.cpu(), causal)
                ins = [t.clone().requires_grad_(True) for t in (qd, kd, vd)]
                out = kernels.fused_attention(*ins, mask=mask_d, is_causal=causal)
                out.backward(doutd)
                checks = {"oneshot": (out, [t.grad for t in ins])}
                if not causal:
                    checks["chunked"] = _chunked(qd, kd, vd, doutd, mask_d, False)
                out_tol, grad_tol = TOLERANCE[dtype]
                for name, (o, grads) in checks.items():
                    out_err = (o.double().cpu() - ref).abs().max().item()
                    grad_err = max(
                        (g.double().cpu() - r).abs().max().item()
                        for g, r in zip(grads, ref_grads, strict=True)
                    )
                    results.append(
                        {
                            "check": f"kernels/{name}",
                            "device": device,
                            "dtype": str(dtype).removeprefix("torch."),
                            "mask": mask_kind,
                            "kv_heads": kv_heads,
                            "head_dim": d,
                            "kernel": kernels.kernel_for(qd, mask_d is not None),
                            "out_err": out_err,
                            "grad_err": grad_err,
                            "pass": out_err <= out_tol and grad_err <= grad_tol,
                        }
                    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    results = run(args.device)
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
