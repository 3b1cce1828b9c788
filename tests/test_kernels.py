"""The kernel layer (``sp_diffusers.parallel.kernels``) in one process: which kernel each device and dtype gets, and that
each path the CPU can run gives SDPA's output and gradients.

Tolerances: fp32 ``atol 2e-6`` (the CPU flash kernel and SDPA's math sum the same O(1) products of S <= 40
keys in another order: a few ulps of O(1)); fp64 1e-12. Fused CUDA kernels cannot run here: on ``meta`` (their
stand-in) the calls are checked for what they return (the shapes aten's meta kernels give), the ops that run
and that no score matrix ``[.., S_q, S_kv]`` is allocated.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sp_diffusers.parallel import kernels


def _inputs(dtype, heads=4, kv_heads=4, sq=40, skv=33, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, d, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, skv, d, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, skv, d, generator=g, dtype=dtype)
    dout = torch.randn(2, heads, sq, d, generator=g, dtype=dtype)
    return q, k, v, dout


def _masks(sq, skv):
    g = torch.Generator().manual_seed(7)
    keys = torch.rand(2, 1, 1, skv, generator=g) > 0.3
    full = torch.rand(2, 1, sq, skv, generator=g) > 0.5
    full[:, :, 3] = False  # a row that sees no key: output 0, no gradient
    return {"none": None, "key_padding": keys, "full_with_empty_row": full}


def _reference(q, k, v, dout, mask, causal):
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in ins[1:])
    out = F.scaled_dot_product_attention(ins[0], kk, vv, attn_mask=mask, is_causal=causal)
    out = torch.nan_to_num(out)  # SDPA's math path gives nan for a row with no key; the kernels give 0
    out.backward(dout)
    return out.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("kind", ["cpu_flash", "math"])
@pytest.mark.parametrize("mask_name", ["none", "key_padding", "full_with_empty_row", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_cpu_path_matches_sdpa(kind, mask_name, kv_heads):
    dtype = torch.float32 if kind == "cpu_flash" else torch.float64
    atol = 2e-6 if dtype == torch.float32 else 1e-12
    q, k, v, dout = _inputs(dtype, kv_heads=kv_heads, skv=40)
    causal = mask_name == "causal"
    mask = None if causal else _masks(40, 40)[mask_name]
    ref, ref_grads = _reference(q, k, v, dout, mask, causal)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with mock.patch.object(kernels, "kernel_for", lambda t, has_mask: kind):
        out = kernels.fused_attention(*ins, mask=mask, is_causal=causal)
        out.backward(dout)
    assert (out - ref).abs().max() <= atol
    for g, r in zip((t.grad for t in ins), ref_grads, strict=True):
        assert g.shape == r.shape and (g - r).abs().max() <= atol


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):  # allocated elements (an expanded view allocates nothing)
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize(
    ("dtype", "masked", "expected"),
    [
        (torch.bfloat16, False, "flash"),
        (torch.float16, False, "flash"),
        (torch.bfloat16, True, "efficient"),
        (torch.float32, False, "efficient"),
        (torch.float32, True, "efficient"),
    ],
)
@pytest.mark.parametrize("d", [16, 12])
def test_meta_stands_in_for_cuda_with_fused_kernels_only(dtype, masked, expected, d):
    """On meta (CUDA's stand-in) half precision without a mask runs flash, everything else the efficient kernel
    (its bias takes the mask); a head dim of 12 is padded to 16 and cut back; GQA K/V get their heads' sums."""
    q = torch.empty(2, 4, 40, d, device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty(2, 2, 33, d, device="meta", dtype=dtype, requires_grad=True)
    mask = torch.ones(2, 1, 1, 33, dtype=torch.bool, device="meta") if masked else None
    assert kernels.kernel_for(q, masked) == expected
    with _Ops() as ops:
        out = kernels.fused_attention(q, k, k, mask=mask)
        out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape
    attention = {op for op in ops.ops if "attention" in op or "softmax" in op}
    assert attention == {
        f"aten._scaled_dot_product_{expected}_attention.default",
        f"aten._scaled_dot_product_{expected}_attention_backward.default",
    }
    assert attention <= kernels.FUSED_OPS
    assert ops.largest < 2 * 4 * 40 * 33, "a [B, H, S_q, S_kv] score matrix was allocated"


def test_fp64_off_cpu_takes_the_math_kernel():
    assert kernels.kernel_for(torch.empty(1, 1, 1, 8, device="meta", dtype=torch.float64), False) == "math"
    assert kernels.kernel_for(torch.empty(1, 1, 1, 8, dtype=torch.float64), True) == "cpu_flash"


def test_the_gpu_check_of_the_kernels_passes_on_the_cpu_kernels():
    """``tests/gpu_kernels.py`` (run on a GPU machine with ``--device cuda``) holds the fused kernels to fp64 SDPA,
    one-shot and chunked as the ring uses them; here the same checks run on the CPU kernels, so the check
    itself is known to pass where the kernels are right."""
    from .gpu_kernels import run

    results = run("cpu")
    assert len(results) == 42
    failed = [r for r in results if not r["pass"]]
    assert not failed, failed
