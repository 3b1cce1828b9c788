"""Shared by the benchmarks: start N ranks, time with barriers, measure peak memory, on CPU or GPU.

Backend and device: ``--backend`` / ``--device`` (:func:`add_device_arguments`), defaulting to the environment
(``SP_BENCH_BACKEND``, ``SP_BENCH_DEVICE``) and then to gloo on the CPU. With ``--device cuda`` rank r runs on
GPU r mod the GPU count (gloo ranks may share one GPU; NCCL needs one GPU per rank), every clock is read after
``torch.cuda.synchronize()`` (a GPU runs ahead of the host), and peak memory is ``max_memory_allocated``.

Peak memory on CPU: torch keeps no high-water mark for CPU tensors, so a profiler pass with
``profile_memory=True`` records every allocation and free; the running sum's maximum is the peak above
what was live when the pass started (inputs excluded). Timing passes run without the profiler.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# dense bf16 / fp32 peaks (TFLOP/s) of the GPUs the benchmarks name, from the vendors' datasheets; others: None
PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--device`` (defaults: ``SP_BENCH_BACKEND`` / ``SP_BENCH_DEVICE``, else gloo / cpu)."""
    parser.add_argument(
        "--backend", default=os.environ.get("SP_BENCH_BACKEND", "gloo"), choices=("gloo", "nccl")
    )
    parser.add_argument("--device", default=os.environ.get("SP_BENCH_DEVICE", "cpu"), choices=("cpu", "cuda"))


def device() -> torch.device:
    """This rank's device (set by :func:`spawn`)."""
    if os.environ.get("SP_BENCH_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    """Wait for this rank's GPU (nothing on the CPU): a clock read after this covers the work queued before."""
    if device().type == "cuda":
        torch.cuda.synchronize()


# Ranks start from a fork server that imported these once (a spawned rank spent seconds importing them, each
# time). Libraries only, and no CUDA call: a rank starts as a spawned one would, on either device.
PRELOAD = ["torch", "torch.distributed", "diffusers", "transformers"]


def rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server of ``PRELOAD``. A rank calls
    :func:`take_environment` first."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def take_environment(env: dict[str, str]) -> None:
    """The starting process's environment (``dict(os.environ)`` there): a forked rank has the fork server's, which
    may be older, and a spawned rank would have had the caller's."""
    os.environ.clear()
    os.environ.update(env)


def _child(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable,
    args: tuple,
    threads: int,
    backend: str,
    dev: str,
    env: dict[str, str],
    q,
) -> None:
    take_environment(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["SP_BENCH_DEVICE"] = dev
    if dev == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = (
            ""  # a CPU run stays on the CPU on a GPU host too (engine defaults)
        )
    torch.set_num_threads(threads)
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        q.put((rank, fn(rank, world, *args)))
    except BaseException as err:
        import traceback

        q.put((rank, {"error": f"{err!r}\n{traceback.format_exc()}"}))
        raise
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable,
    world: int,
    *args: Any,
    threads: int = 1,
    backend: str | None = None,
    device: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return results in rank order. ``backend`` /
    ``device`` default to the environment (``SP_BENCH_BACKEND`` / ``SP_BENCH_DEVICE``), then gloo / cpu."""
    backend = backend or os.environ.get("SP_BENCH_BACKEND", "gloo")
    device = device or os.environ.get("SP_BENCH_DEVICE", "cpu")
    ctx = rank_context()
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(
                target=_child, args=(r, world, init, fn, args, threads, backend, device, dict(os.environ), q)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=3600) for _ in range(world))
        for p in procs:
            p.join()
    for r in range(world):
        if isinstance(results[r], dict) and "error" in results[r]:
            raise RuntimeError(f"rank {r} failed: {results[r]['error']}")
    return [results[r] for r in range(world)]


def time_it(fn: Callable[[], Any], repeats: int, warmup: int = 1, group=None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs; ranks start each run together (barrier)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize()
        if dist.is_initialized():
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_samples(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1, rotate: bool = False
) -> dict[str, list[float]]:
    """Seconds of every run per callable, run round-robin (each repetition runs each once, ranks starting
    together) so slow phases of a noisy machine hit every variant alike. ``rotate``: repetition i starts at
    the i-th callable, so none always runs right after the same neighbour (or first, after the barrier)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)] if rotate else names
        for name in order:
            synchronize()
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            fns[name]()
            synchronize()
            samples[name].append(time.perf_counter() - start)
    return samples


def interleaved_times(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per callable, run round-robin (:func:`interleaved_samples`)."""
    return {name: statistics.median(ts) for name, ts in interleaved_samples(fns, repeats, warmup).items()}


def memory_profile(fn: Callable[[], Any]) -> tuple[int, int]:
    """(peak, retained): bytes allocated by ``fn`` above what was live when it started, at their maximum
    and at the end (what ``fn`` left alive, e.g. activations a forward saved for backward). CPU: the profiler;
    GPU: the allocator's own counters (``max_memory_allocated``)."""
    if device().type == "cuda":
        synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        synchronize()
        return torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak, current


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated by ``fn`` above what was live when it started (CPU, via the profiler)."""
    return memory_profile(fn)[0]


def max_over_ranks(x: float) -> float:
    """The largest ``x`` over all ranks (timings and memory are reported for the slowest/largest rank)."""
    from sp_diffusers.parallel.devices import collective_device

    t = torch.tensor([x], dtype=torch.float64).to(collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def count_flops(fn: Callable[[], Any]) -> float:
    """The FLOPs ``fn`` runs on this rank (torch's ``FlopCounterMode``: matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return float(counter.get_total_flops())


def gpu_peak_tflops(dtype: torch.dtype, dev: torch.device | None = None) -> float | None:
    """The datasheet's dense peak of this GPU for ``dtype`` (None on CPU or an unknown GPU)."""
    if (dev or device()).type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    kind = "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    return next((peaks[kind] for model, peaks in PEAK_TFLOPS.items() if model in name), None)


def achieved(
    flops: float, seconds: float, dtype: torch.dtype, dev: torch.device | None = None
) -> dict[str, float | None]:
    """Achieved TFLOP/s for ``flops`` in ``seconds``, and its fraction of the GPU's peak (None on CPU)."""
    tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
    peak = gpu_peak_tflops(dtype, dev)
    return {"tflops": tflops, "fraction_of_peak": tflops / peak if peak else None}


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")
