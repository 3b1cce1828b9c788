"""Shared by the benchmarks: spawn N ranks (gloo, 1 thread each), time with barriers, measure peak memory.

Peak memory on CPU: torch keeps no high-water mark for CPU tensors, so a profiler pass with
``profile_memory=True`` records every allocation and free; the running sum's maximum is the peak above
what was live when the pass started (inputs excluded). Timing passes run without the profiler.
"""

from __future__ import annotations

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


def _child(rank: int, world: int, init_file: str, fn: Callable, args: tuple, threads: int, q) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
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


def spawn(fn: Callable, world: int, *args: Any, threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return results in rank order."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(target=_child, args=(r, world, init, fn, args, threads, q)) for r in range(world)
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
        if dist.is_initialized():
            dist.barrier(group)
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_times(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per callable, running them round-robin (each repetition runs each once, ranks
    starting together) so slow phases of a noisy machine hit every variant alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def memory_profile(fn: Callable[[], Any]) -> tuple[int, int]:
    """(peak, retained): bytes allocated by ``fn`` above what was live when it started, at their maximum
    and at the end (what ``fn`` left alive, e.g. activations a forward saved for backward). CPU, profiler."""
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
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")
