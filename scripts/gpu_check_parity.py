"""The parity checks of ``scripts/gpu_check.py`` (see its docstring): Ulysses attention and a tiny model on 2
gloo ranks sharing one device, fp32 and bf16, every SDPA kernel."""

from __future__ import annotations

import argparse
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

KERNELS = ("flash", "efficient", "cudnn", "math")
FP32_TOL = (1e-5, 1e-4)  # (atol, rtol): only the order of fp32 sums differs
BF16_TOL = 1e-2  # relative to |ref| + max |ref|: a few bf16 roundings (2^-8 each)


def _result(check: str, passed: bool | None, **fields: Any) -> dict[str, Any]:
    return {
        "check": check,
        "pass": passed,
        "max_error": fields.pop("max_error", None),
        "max_memory_allocated": fields.pop("max_memory_allocated", None),
        "seconds": fields.pop("seconds", None),
        **fields,
    }


def _sdpa_backend(kernel: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[kernel]


def _excess(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(max |got - ref|, the largest ratio of it to the tolerance: <= 1 passes)."""
    d = (got.double() - ref.double()).abs()
    r = ref.double().abs()
    tol = FP32_TOL[0] + FP32_TOL[1] * r if dtype == torch.float32 else BF16_TOL * (r + r.max())
    return d.max().item(), (d / tol).max().item()


def _parity_config(rank: int, world: int, device: torch.device):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=world))
    config.setup(rank, world, device, mesh=mesh)
    return config


def _op_case(rank, world, device, dtype, kernel, size, config) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from sp_diffusers.parallel.attention import ulysses_sdpa_attention

    s, heads, head_dim = size
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, s, heads, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(4)]
    with sdpa_kernel(_sdpa_backend(kernel)):
        try:
            ref_in = [t.transpose(1, 2).detach().requires_grad_(True) for t in full[:3]]
            ref_out = F.scaled_dot_product_attention(*ref_in)
            ref_out.backward(full[3].transpose(1, 2))
        except RuntimeError as err:  # this kernel does not take this dtype / device
            return {
                "skip": f"{kernel} has no kernel for {dtype} on {device.type}: {str(err).splitlines()[0]}"
            }
        ref = [ref_out.transpose(1, 2), *(t.grad.transpose(1, 2) for t in ref_in)]
        part = slice(rank * s // world, (rank + 1) * s // world)
        local = [t[:, part].detach().requires_grad_(True) for t in full[:3]]
        out = ulysses_sdpa_attention(*local, _parallel_config=config)
        out.backward(full[3][:, part])
    got = [out, *(t.grad for t in local)]
    return _compare(got, [r[:, part] for r in ref], dtype)


def _compare(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    errors = [_excess(a.detach(), b.detach(), dtype) for a, b in zip(got, ref, strict=True)]
    return {"max_error": max(e for e, _ in errors), "ratio": max(r for _, r in errors)}


def _model_case(rank, world, device, dtype) -> dict[str, Any]:
    import copy

    import torch.distributed as dist

    import sp_diffusers
    from sp_diffusers.parallel.devices import to_device
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model("qwenimage", seed=0, dtype=dtype).to(device)
    inputs = to_device(
        tiny_inputs("qwenimage", model, batch=2, seed=1, text_len=16, image_hw=(16, 16)), device
    )
    reference = copy.deepcopy(model)
    ref_out = reference(**inputs, return_dict=False)[0]
    weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    (ref_out.float() * weight).mean().backward()
    model.set_attention_backend("ulysses_sdpa")
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=world))
    out = model(**inputs, return_dict=False)[0]
    (out.float() * weight).mean().backward()
    got, ref = [out], [ref_out]
    for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True):
        grad = (
            p.grad.detach().clone().float()
            if p.grad is not None
            else torch.zeros_like(p, dtype=torch.float32)
        )
        dist.all_reduce(grad)  # the gradient contract: per-rank gradients SUM to the full one
        got.append(grad)
        ref.append(p_ref.grad.float() if p_ref.grad is not None else torch.zeros_like(grad))
    return _compare(got, ref, dtype)


def parity_rank(rank: int, world: int, device_type: str, size: tuple[int, int, int]) -> list[dict[str, Any]]:
    import logging

    from diffusers.utils import logging as dlogging

    import sp_diffusers

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    sp_diffusers.install()
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    config = _parity_config(rank, world, device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        for kernel in KERNELS:
            start = time.perf_counter()
            row = _guard(lambda d=dtype, k=kernel: _op_case(rank, world, device, d, k, size, config))
            rows.append(
                {"check": f"parity/op/{name}/{kernel}", "seconds": time.perf_counter() - start, **row}
            )
        start = time.perf_counter()
        row = _guard(lambda d=dtype: _model_case(rank, world, device, d))
        rows.append({"check": f"parity/model/{name}/auto", "seconds": time.perf_counter() - start, **row})
    for row in rows:
        row["max_memory_allocated"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return rows


def _guard(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:800], "trace": traceback.format_exc()[-1500:]}


def check_parity(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks._harness import spawn

    size = (256, 4, 32) if args.device == "cpu" else (4096, 16, 128)
    ranks = spawn(parity_rank, 2, args.device, size, backend="gloo", device=args.device)
    results = []
    for rows in zip(*ranks, strict=True):  # the same check on both ranks: the worse one counts
        first = rows[0]
        if any("error" in r for r in rows):
            bad = next(r for r in rows if "error" in r)
            results.append(_result(first["check"], False, seconds=first["seconds"], detail=bad["error"]))
        elif "skip" in first:
            results.append(_result(first["check"], None, seconds=first["seconds"], detail=first["skip"]))
        else:
            ratio = max(r["ratio"] for r in rows)
            results.append(
                _result(
                    first["check"],
                    ratio <= 1.0,
                    max_error=max(r["max_error"] for r in rows),
                    max_memory_allocated=first["max_memory_allocated"],
                    seconds=max(r["seconds"] for r in rows),
                    detail=f"error / tolerance {ratio:.3g} (<= 1 passes), 2 gloo ranks on {args.device}",
                )
            )
    return results
