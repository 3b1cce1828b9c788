"""The fake runs of a plan, in worker processes: each trace is a few seconds of one CPU core, a plan tens of them.

Workers are forked from the planner's process where the platform forks (Linux), after it has imported what every
trace needs, so none imports torch, diffusers and transformers again (~10 s each under ``spawn``); their
imported objects are frozen out of the garbage collector's reach, so a trace's collections look at its own.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import sys
from typing import Any

from .trace import Measure, TraceRequest, run_trace

__all__ = ["run_all"]


def run_all(tasks: list[TraceRequest], workers: int, progress: bool) -> list[tuple[Measure, Measure | None]]:
    """``run_trace`` of every task, in order: in this process (``workers`` <= 1) or in a pool of ``workers``."""
    if workers <= 1:
        bar = _bar(len(tasks), progress)
        try:
            out = []
            for t in tasks:
                out.append(run_trace(t))
                bar.update(1)
            return out
        finally:
            bar.close()
    _import_for_workers(tasks[0])
    with futures.ProcessPoolExecutor(workers, mp_context=_start_method(), initializer=_quiet_worker) as pool:
        jobs = [pool.submit(run_trace, t) for t in tasks]
        bar = _bar(len(tasks), progress)  # after the workers start: tqdm's monitor thread is not forked
        try:
            for _ in futures.as_completed(jobs):
                bar.update(1)
        finally:
            bar.close()
        return [j.result() for j in jobs]


def _start_method() -> Any:
    """Workers forked from this process inherit what it imported (torch, diffusers, transformers' import tables,
    peft, the installed patches): under ``spawn`` each worker imported them again, ~10 s of a plan's two minutes.
    The parent has no CUDA context or process group to inherit (the traces use neither). Where fork is not the
    platform's habit (macOS, Windows), spawn."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _import_for_workers(task: TraceRequest) -> None:
    """What every trace imports, imported once here, before the workers fork."""
    import sp_diffusers

    from ..families.kinds import model_class

    sp_diffusers.install()
    model_class(task.spec.kind)


def _quiet_worker() -> None:
    import gc
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)  # fake ops do no arithmetic
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    # the imported modules are never garbage: out of the collector's reach, each trace's two full collections
    # (trace.py) look at that trace's objects only, not at the hundreds of thousands of torch's and diffusers'
    gc.freeze()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, progress: bool) -> Any:
    if not progress:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the [train] extra
        return _NoBar()
    return tqdm(total=total, desc="fake runs", unit="run", leave=False)
