"""The embedded demo: a tiny model from a real diffusers class, forward + backward under Ulysses SP,
checked against one process on the same rank.

    torchrun --nproc_per_node 2 -m sp_diffusers.cli demo [--model qwenimage] [--backend ulysses_sdpa]

On CPU (gloo) or on GPUs (NCCL, ``cuda:LOCAL_RANK``): the launch picks the backend, the demo puts the model
and its inputs on this rank's device. One process (``--nproc_per_node 1``) runs the backend without an
exchange (degree 1): a check of the install and the device path rather than of sequence parallelism.

Every rank builds the same model and inputs (same seeds), computes the single-process reference, then
the SP forward/backward; gradients are summed over the SP group (the gradient contract) and compared.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import time
import warnings

import torch
import torch.distributed as dist

from .parallel.devices import collective_device, default_device, to_device
from .parallel.launch import init_distributed

DEMO_ATOL = 1e-5
DEMO_RTOL = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwenimage", choices=("qwenimage", "flux", "wan"))
    parser.add_argument("--backend", default="ulysses_sdpa", choices=("ulysses_sdpa", "native"))
    parser.add_argument("--ulysses-degree", type=int, default=None, help="default: the world size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=32, help="latent height = width (before patching)")
    parser.add_argument("--text-len", type=int, default=16, help="padded text length (ragged masks inside)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward+backward repetitions")
    parser.add_argument(
        "--json", default=None, help="rank 0 also writes the result here (scripts/gpu_check.sh)"
    )


def _forward_backward(model, inputs, weight) -> tuple[torch.Tensor, float]:
    _synchronize(weight.device)
    start = time.perf_counter()
    out = model(**inputs, return_dict=False)[0]
    (out * weight).mean().backward()
    _synchronize(weight.device)  # a GPU runs ahead of the host: read the clock once its work is done
    return out.detach(), time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_result(path: str, summary: torch.Tensor, ok: bool, device: torch.device, seconds: float) -> None:
    import json

    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result = {
        "pass": ok,
        "max_error": max(summary[0].item(), summary[1].item()),
        "max_memory_allocated": peak,
        "seconds": seconds,
        "device": str(device),
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
    }
    with open(path, "w") as f:
        json.dump(result, f)


def _allclose_excess(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().sub(DEMO_RTOL * b.abs()).max().item()


def run(args: argparse.Namespace) -> int:
    from diffusers.utils import logging as dlogging

    import sp_diffusers

    from .tiny import tiny_inputs, tiny_model

    init_distributed(required_by="demo")
    dlogging.set_verbosity(logging.ERROR)
    # diffusers' own gather calls a torch API that torch 2.13 deprecates; nothing for a demo user to act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\..*")
    rank, world = dist.get_rank(), dist.get_world_size()
    degree = args.ulysses_degree or world
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    report = sp_diffusers.install()
    if rank == 0:
        print(report, flush=True)

    device = default_device()
    if device.type == "cuda":
        # fp32 parity at 1e-5 needs full-precision fp32 (no TF32 in convolutions or matmuls)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(args.model, seed=0)
    inputs = tiny_inputs(
        args.model, model, batch=args.batch, seed=1, text_len=args.text_len, image_hw=(args.image_size,) * 2
    )
    model, inputs = model.to(device), to_device(inputs, device)
    reference = copy.deepcopy(model)
    shape = reference(**inputs, return_dict=False)[0].shape
    weight = to_device(torch.randn(shape, generator=torch.Generator().manual_seed(2)), device)

    ref_times = []
    for _ in range(args.repeats):
        reference.zero_grad(set_to_none=True)
        ref_out, t = _forward_backward(reference, inputs, weight)
        ref_times.append(t)

    model.set_attention_backend(args.backend)
    if degree > 1:  # at degree 1 (one process) the backend runs whole sequences: the same check, no exchange
        model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=degree))
    sp_times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        sp_out, t = _forward_backward(model, inputs, weight)
        sp_times.append(t)

    out_err = (sp_out - ref_out).abs().max().item()
    out_excess = _allclose_excess(sp_out, ref_out)
    grad_err, grad_excess = 0.0, -1.0
    for (_name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)  # per-rank gradients are partial: their SUM is the full gradient
        g_ref = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        grad_err = max(grad_err, (g - g_ref).abs().max().item())
        grad_excess = max(grad_excess, _allclose_excess(g, g_ref))
    tokens = sp_out.numel() // sp_out.shape[0] // sp_out.shape[-1] if args.model != "wan" else None
    ok = out_excess <= DEMO_ATOL and grad_excess <= DEMO_ATOL
    summary = torch.tensor([out_err, grad_err, float(ok)]).to(collective_device())
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    summary = summary.cpu()
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"\n{args.model} ({n_params / 1e6:.2f}M params, batch {args.batch}"
            + (f", {tokens} image tokens" if tokens else "")
            + f", text {args.text_len} padded, ragged mask) | backend {args.backend} | "
            f"Ulysses degree {degree} of {world} ranks | {device.type} ({dist.get_backend()})"
        )
        print(f"  max |output - one process|           {summary[0].item():.3e}")
        print(f"  max |grad (SUM over SP) - one process| {summary[1].item():.3e}")
        print(
            f"  tolerance: |d| <= {DEMO_ATOL:g} + {DEMO_RTOL:g} * |ref| (fp32) -> {'PASS' if ok else 'FAIL'}"
        )
        best_ref, best_sp = min(ref_times), min(sp_times)
        if args.json:
            _write_result(args.json, summary, ok, device, best_sp)
        print(
            f"  forward+backward: one process {best_ref * 1e3:.1f} ms, SP {best_sp * 1e3:.1f} ms per rank "
            f"(best of {args.repeats}; a tiny model: communication dominates, see benchmarks/)"
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1
