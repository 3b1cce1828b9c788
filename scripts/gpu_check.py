"""The GPU acceptance check behind ``scripts/gpu_check.sh``: one JSON line per check, exit status 1 on a failure.

    python scripts/gpu_check.py [--device cuda|cpu] [--only demo parity engine_step compile] [--quick] [--json-out F]

Checks (``--device cuda``: sized for one H200, a few minutes in all):

- ``demo``: ``sp-diffusers demo`` under torchrun at world 1 (NCCL on a GPU): the install, the model and inputs
  on ``cuda:0``, the backend, a collective on the device.
- ``parity/<op|model>/<dtype>/<kernel>``: 2 gloo ranks sharing the GPU (NCCL refuses two ranks on one GPU),
  Ulysses degree 2. ``op``: ``ulysses_sdpa_attention`` forward + backward against full-sequence SDPA on one
  rank, SDPA's kernel forced with ``torch.nn.attention.sdpa_kernel`` (flash, efficient, cuDNN; a kernel that
  does not take a dtype, such as flash in fp32, is reported as a skip, not a failure). ``model``: a tiny
  Qwen-Image forward + backward (the gradient SUM over the SP group) against one process.
  Tolerances: fp32 ``|d| <= 1e-5 + 1e-4 |ref|`` (only the order of sums differs); bf16 ``|d| <= 1e-2 (|ref| +
  max |ref|)`` (a few bf16 roundings, 2^-8 each, of values up to the largest).
- ``engine_step``: one ``FSDPEngine`` step (bf16, activation checkpointing, AdamW) of 4 Wan2.1-14B blocks (40
  heads x 128, FFN 13824, text 4096) on 32,760 video tokens (480p x 81 frames), built on meta and
  materialised on the GPU. ``forward_backward`` runs under ``torch.cuda.set_sync_debug_mode("error")``: any
  host sync there fails the check with its location; the rest of the step may sync once (the metrics and
  gradient norm, read together).

- ``compile``: eager against ``train.compile: blocks`` on one GPU (2 Wan2.1-14B blocks, bf16, 8,190 tokens), a
  forward without grad and a forward + backward: the two speedups ``plan --rl --compile blocks`` assumes
  (``--compile-speedup``, ``--compile-train-speedup``), measured; the compiled output equal to eager's within the
  parity tolerance.

``--device cpu`` is the dry mode CI runs so that this script cannot rot: the same code on gloo/CPU at toy sizes
(the math and flash kernels; efficient and cuDNN have no CPU kernel and report a skip), host syncs counted by a
dispatch mode (``aten._local_scalar_dense``) instead of CUDA's sync debug mode.

Each line: ``{"check", "pass" (true / false / null for a skip), "max_error", "max_memory_allocated" (bytes, GPU
only), "seconds", "detail"}``; a last line sums up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/ (the spawn harness) from the tree, appended: sp_diffusers must come from where gpu_check.sh laid
# it out (with its patches/), or from an install, never from the tree's bare sp_diffusers/ folder
if ROOT not in sys.path:
    sys.path.append(ROOT)

import torch  # noqa: E402
from gpu_check_parity import BF16_TOL, FP32_TOL, _result, check_parity  # noqa: E402

CHECKS = ("demo", "parity", "engine_step", "compile")


# ------------------------------------------------------------------------------------------------- demo


def check_demo(args: argparse.Namespace) -> list[dict[str, Any]]:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "demo.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        cmd += ["-m", "sp_diffusers.cli", "demo", "--json", out, "--repeats", "2"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the launch then picks gloo
        # cwd elsewhere: `-m` puts the cwd first on sys.path, and the tree's sp_diffusers/ lacks its patches/
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-2000:]
            return [_result("demo", False, seconds=time.perf_counter() - start, detail=tail)]
        with open(out) as f:
            got = json.load(f)
    want = "nccl" if args.device == "cuda" else "gloo"
    ok = bool(got["pass"]) and got["backend"] == want and got["device"].startswith(args.device)
    return [
        _result(
            f"demo/{got['backend']}/world{got['world']}",
            ok,
            max_error=got["max_error"],
            max_memory_allocated=got["max_memory_allocated"],
            seconds=time.perf_counter() - start,
            detail=f"device {got['device']}, fwd+bwd {got['seconds'] * 1e3:.1f} ms",
        )
    ]


# ------------------------------------------------------------------------------------------- engine step

WAN14B_BLOCK = dict(
    num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, text_dim=4096, freq_dim=256
)
TINY_BLOCK = dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=256, text_dim=64, freq_dim=64)


@contextlib.contextmanager
def _no_host_sync(device: torch.device) -> Iterator[list[str]]:
    """Any host sync inside raises (CUDA: torch's sync debug mode); on CPU the ``.item()``-like reads are
    counted by a dispatch mode and returned in the list (CPU tensors need no sync: this is the stand-in)."""
    if device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield []
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    with _count_reads() as reads:
        yield reads


@contextlib.contextmanager
def _count_reads() -> Iterator[list[str]]:
    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                where = "".join(traceback.format_stack(limit=6)[:-1])
                # AdamW's step counter is a host tensor on a GPU too: reading it there is no sync
                if f"torch{os.sep}optim{os.sep}" not in where:
                    reads.append(where)
            return func(*args, **(kwargs or {}))

    with Reads():
        yield reads


@contextlib.contextmanager
def _counting_syncs(device: torch.device) -> Iterator[list[str]]:
    """Host syncs inside, counted (CUDA: sync debug mode "warn", its warnings collected)."""
    if device.type != "cuda":
        with _count_reads() as reads:
            yield reads
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        found: list[str] = []
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
            found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))


def check_engine_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    import sp_diffusers
    from benchmarks._harness import achieved
    from sp_diffusers import FSDPEngine
    from sp_diffusers.engine.weights import meta_model

    start = time.perf_counter()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    block = WAN14B_BLOCK if args.device == "cuda" and not args.quick else TINY_BLOCK
    # (frames, height, width) of the latent: 21 x 60 x 104 -> 21 x 30 x 52 = 32,760 tokens (480p x 81 frames)
    frames, height, width = (21, 60, 104) if block is WAN14B_BLOCK else (2, 8, 8)
    text = 512 if block is WAN14B_BLOCK else 16
    config = dict(block, num_layers=args.blocks, patch_size=(1, 2, 2), in_channels=16, out_channels=16)
    model = meta_model(WanTransformer3DModel, config)

    def init(m: torch.nn.Module) -> None:
        for p in m.parameters():
            p.normal_(0.0, 0.02)

    sp_diffusers.install()
    engine = FSDPEngine(
        model,
        device=device,
        weights=init,
        mixed_precision="bf16" if device.type == "cuda" else None,
        activation_checkpointing=True,
    )
    dtype = next(engine.model.parameters()).dtype
    g = torch.Generator(device=device).manual_seed(0)
    batch = {
        "hidden_states": torch.randn(1, 16, frames, height, width, generator=g, device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(
            1, text, block["text_dim"], generator=g, device=device, dtype=dtype
        ),
        "timestep": torch.full((1,), 500.0, device=device),
    }
    target = torch.randn(batch["hidden_states"].shape, generator=g, device=device, dtype=torch.float32)
    tokens = frames * (height // 2) * (width // 2)

    def loss_fn(eng, b):
        return (eng.forward(**b).float() - target).square().mean(), {}

    guarded = engine.forward_backward
    inside: list[str] = []

    def forward_backward(*a, **k):
        with _no_host_sync(device) as reads:
            out = guarded(*a, **k)
        inside.extend(reads)
        return out

    engine.forward_backward = forward_backward
    flops = FlopCounterMode(display=False)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with flops, _counting_syncs(device) as syncs:  # step 1: FLOPs counted, syncs outside forward_backward
            metrics = engine.train_step(batch, loss_fn)
        _sync(device)
        t0 = time.perf_counter()
        engine.train_step(batch, loss_fn)  # step 2: timed
        _sync(device)
        seconds = time.perf_counter() - t0
    except Exception as err:
        return [_failed("engine_step", err, start)]
    rate = achieved(flops.get_total_flops(), seconds, dtype, device)
    rest = len(syncs) - len(inside)  # on CPU the outer count includes the inner one
    ok = not inside and rest <= 1 and all(v == v for v in metrics.values() if isinstance(v, float))
    return [
        _result(
            f"engine_step/wan_{args.blocks}_blocks/{tokens}_tokens",
            ok,
            max_memory_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            seconds=seconds,
            tflops=rate["tflops"],
            fraction_of_peak=rate["fraction_of_peak"],
            host_syncs_in_forward_backward=len(inside),
            host_syncs_in_rest_of_step=rest,
            loss=metrics.get("loss"),
            detail=(
                f"{sum(p.numel() for p in engine.model.parameters()) / 1e9:.2f}B params {dtype}, activation "
                f"checkpointing, AdamW; syncs outside forward_backward: {syncs[:2]}"
                + (f"; reads in forward_backward: {inside[:1]}" if inside else "")
            ),
        )
    ]


# ------------------------------------------------------------------------------------------------ compile


def check_compile(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Eager against ``compile_model(model, "blocks")`` on one device: 2 Wan2.1-14B blocks (bf16) at 8,190 video
    tokens, a forward without grad (a rollout step) and a forward + backward (a training micro-step), interleaved,
    medians. Their ratios are what ``plan --rl --compile blocks`` takes as ``--compile-speedup`` and
    ``--compile-train-speedup``; the compiled output must equal eager's within the parity tolerance."""
    import copy

    from diffusers import WanTransformer3DModel

    from sp_diffusers.engine.compiling import compile_model

    start = time.perf_counter()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    big = args.device == "cuda" and not args.quick
    block = WAN14B_BLOCK if big else TINY_BLOCK
    frames, height, width = (21, 30, 52) if big else (2, 8, 8)  # 21 x 15 x 26 = 8,190 tokens on a GPU
    text, repeats = (512, 5) if big else (16, 2)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dict(block, num_layers=2, patch_size=(1, 2, 2), in_channels=16, out_channels=16)
    torch.manual_seed(0)
    with torch.device(device):
        eager = WanTransformer3DModel(**config).to(dtype)
    compiled = copy.deepcopy(eager)
    compile_model(compiled, "blocks")
    g = torch.Generator(device=device).manual_seed(0)
    batch = {
        "hidden_states": torch.randn(1, 16, frames, height, width, generator=g, device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(1, text, block["text_dim"], generator=g, device=device, dtype=dtype),
        "timestep": torch.full((1,), 500.0, device=device),
    }

    def forward(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(**batch, return_dict=False)[0]

    def train(m: torch.nn.Module) -> None:
        m(**batch, return_dict=False)[0].float().square().mean().backward()
        m.zero_grad(set_to_none=True)

    def timed(fn: Any, m: torch.nn.Module) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn(m)
        _sync(device)
        return time.perf_counter() - t0

    try:
        t0 = time.perf_counter()
        out, ref = forward(compiled), forward(eager)  # the first calls compile
        train(compiled)
        compile_seconds = time.perf_counter() - t0
        times: dict[str, list[float]] = {k: [] for k in ("fwd_eager", "fwd_blocks", "train_eager", "train_blocks")}
        for _ in range(repeats):  # interleaved: the device's clocks and neighbours move both alike
            times["fwd_eager"].append(timed(forward, eager))
            times["fwd_blocks"].append(timed(forward, compiled))
            times["train_eager"].append(timed(train, eager))
            times["train_blocks"].append(timed(train, compiled))
    except Exception as err:
        return [_failed("compile", err, start)]
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ref, out = ref.float(), out.float()
    err = (out - ref).abs()
    if dtype == torch.float32:
        atol, rtol = FP32_TOL
        ok = bool((err <= atol + rtol * ref.abs()).all())
    else:
        ok = bool((err <= BF16_TOL * (ref.abs() + ref.abs().max())).all())
    tokens = frames * (height // 2) * (width // 2)
    return [
        _result(
            f"compile/wan_2_blocks/{tokens}_tokens",
            ok and all(v > 0 for v in med.values()),
            max_error=float(err.max()),
            max_memory_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            seconds=time.perf_counter() - start,
            compile_seconds=compile_seconds,
            compile_speedup=med["fwd_eager"] / med["fwd_blocks"],
            compile_train_speedup=med["train_eager"] / med["train_blocks"],
            median_seconds=med,
            detail=f"{dtype}, medians of {repeats} interleaved; plan --rl --compile blocks --compile-speedup "
            f"{med['fwd_eager'] / med['fwd_blocks']:.2f} --compile-train-speedup "
            f"{med['train_eager'] / med['train_blocks']:.2f}",
        )
    ]


def _failed(check: str, err: Exception, start: float) -> dict[str, Any]:
    """The line of a check that raised: its error and the end of its traceback."""
    return _result(
        check,
        False,
        seconds=time.perf_counter() - start,
        detail=f"{type(err).__name__}: {str(err)[:600]}",
        trace=traceback.format_exc()[-2500:],
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the dry mode (toy sizes)")
    p.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    p.add_argument("--blocks", type=int, default=4, help="Wan blocks in the engine step")
    p.add_argument("--quick", action="store_true", help="toy sizes on a GPU too")
    p.add_argument("--json-out", default=None, help="also write every line to this file")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); --device cpu dry-runs"
        )
    runners = {"demo": check_demo, "parity": check_parity, "engine_step": check_engine_step, "compile": check_compile}
    lines: list[dict[str, Any]] = []
    start = time.perf_counter()
    for name in args.only:
        try:
            results = runners[name](args)
        except Exception as err:
            results = [
                _result(
                    name, False, detail=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2500:]
                )
            ]
        for r in results:
            print(json.dumps(r), flush=True)
        lines += results
    failed = [r["check"] for r in lines if r["pass"] is False]
    summary = {
        "check": "summary",
        "pass": not failed,
        "failed": failed,
        "skipped": [r["check"] for r in lines if r["pass"] is None],
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    print(json.dumps(summary), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in [*lines, summary])
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
