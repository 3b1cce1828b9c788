"""Pairs of gloo ranks that run one forward of a tiny Flux.2 and exit as a user's program does; rank 1 never
reads its output. Prints one JSON line: per pair, its style and backend, how each rank ended
(``"ok"``, ``"exit N"``, ``"signal N"``; SIGABRT is ``"signal 6"``).

    python -m tests.workers.exit_ranks --pairs 6 --styles script,harness,global --backends ulysses_sdpa,native
        [--no-exit-hook] [--starve 0]

One parent imports torch and diffusers once and forks every rank (a rank costs its forward, not an import);
a rank leaves through ``sys.exit``, so the interpreter finalizes as at the end of a script. Styles:
``script`` - the model lives in a function that returns, the process group is never destroyed (a plain
torchrun script); ``harness`` - ``destroy_process_group()`` in ``finally`` (diffusers' own context-parallel
test workers); ``global`` - ``destroy_process_group()``, and the model stays referenced to the end (a
module-level ``model = ...``). Pair i takes style i mod len(styles) and backend (i // len(styles)) mod
len(backends). ``--no-exit-hook`` removes the hook that ``install()`` registers (the state before the fix).

What makes the abort near-certain without the hook (a loaded host, made repeatable): rank 1 runs on one CPU
with its gloo worker threads at ``SCHED_IDLE`` (they run only while the main thread is off the CPU) and a
switch interval longer than its life (the main thread never hands the GIL over on request); after the
forward it sleeps in a C call that keeps the GIL. A worker that has to release a finished work then waits
for the GIL until the interpreter finalizes - the state in the core dumps of the diffusers suite. (It is
the worker's turn to release in about half the pairs: docs/reliability.md has the rates.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

_KEPT: list = []  # style "global": the model outlives the run



def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _name(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def _idle_gloo_workers(before: set[int]) -> None:
    """SCHED_IDLE for the gloo worker threads started since ``before``: they run only while the main thread is
    off the CPU. A thread carries the main thread's name until it names itself, so wait for that first."""
    unnamed, deadline = _name(os.getpid()), time.monotonic() + 10
    while True:
        names = {tid: _name(tid) for tid in _threads() - before}
        if unnamed not in names.values() or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    workers = [tid for tid, name in names.items() if name == "pt_gloo_runloop"]
    if not workers:
        raise RuntimeError(f"no gloo worker thread among {sorted(names.values())}: the reproduction does not apply")
    for tid in workers:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _forward(rank: int, style: str, backend: str, before: set[int], args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model("flux2").eval()
    inputs = tiny_inputs("flux2", model, batch=1, text_len=8, image_hw=(4, 4), ragged_text=False)
    model.set_attention_backend(backend)
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=dist.get_world_size()))
    if rank == 1 and args.starve:
        _idle_gloo_workers(before)
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    if rank == 0:
        assert torch.isfinite(out).all()  # rank 0 reads its output; rank 1 never does
    if style == "global":
        _KEPT.append(model)


def _rank(rank: int, init_file: str, style: str, backend: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if rank == 1 and args.starve:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before the gloo threads exist: they inherit it
        sys.setswitchinterval(60.0)
    before = _threads()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        _forward(rank, style, backend, before, args)
        if rank == 1 and args.starve:
            import ctypes

            ctypes.PyDLL(None).usleep(50_000)  # PyDLL: the call keeps the GIL
    finally:
        if style in ("harness", "global"):
            dist.destroy_process_group()


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else f"exit {code}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--styles", default="script", help="comma-separated, used in turn: script,harness,global")
    parser.add_argument("--style", help="one style (same as --styles STYLE)")
    parser.add_argument("--no-exit-hook", action="store_true")
    parser.add_argument("--backends", default="ulysses_sdpa", help="comma-separated: ulysses_sdpa,native")
    parser.add_argument("--backend", help="one backend (same as --backends BACKEND)")
    parser.add_argument("--starve", type=int, default=1, help="0: no help for the abort (natural timing)")
    args = parser.parse_args()
    styles = [args.style] if args.style else args.styles.split(",")
    backends = [args.backend] if args.backend else args.backends.split(",")
    plan = [(styles[i % len(styles)], backends[i // len(styles) % len(backends)]) for i in range(args.pairs)]

    import resource

    import torch

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an aborting rank leaves no core file behind
    torch.set_num_threads(1)  # before any fork: no intra-op pool for the children to inherit
    import sp_diffusers
    import sp_diffusers.tiny  # imported once here, not in every rank

    sp_diffusers.install()
    if args.no_exit_hook:
        from sp_diffusers.parallel import exit_hook

        exit_hook.unregister()

    # no `with`/`finally` around the forks: a child's sys.exit unwinds through them and would run the
    # parent's cleanup
    tmp = tempfile.mkdtemp(prefix="sp-exit-")
    pairs = []
    for i, (style, backend) in enumerate(plan):
        init_file = os.path.join(tmp, f"rendezvous-{i}")
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _rank(rank, init_file, style, backend, args)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                sys.exit(code)  # unwinds to the top: the interpreter finalizes as after a script
            pids.append(pid)
        ended = [_ended(os.waitpid(p, 0)[1]) for p in pids]
        pairs.append({"style": style, "backend": backend, "ended": ended})
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"pairs": pairs}), flush=True)


if __name__ == "__main__":
    main()
