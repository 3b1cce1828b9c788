"""Pairs of gloo ranks that run one forward of a tiny Flux.2 and exit as a user's script does; rank 1 never reads
its output. Prints one JSON line: how every rank ended (``"ok"``, ``"exit N"``, ``"signal N"``).

    python -m tests.workers.exit_ranks --pairs 8 [--backend native] [--style script|harness] [--no-exit-hook]

One parent imports torch and diffusers once and forks every rank (a rank costs its forward, not an import);
a rank leaves through ``sys.exit``, so the interpreter finalizes as it does at the end of a script.
``--style script``: the model lives in a function that returns, the process group is never destroyed (the
usual torchrun script). ``--style harness``: ``destroy_process_group()`` in ``finally``, as diffusers' own
context-parallel test workers do. ``--no-exit-hook`` removes the hook ``install()`` registers (the state
before the fix).

What makes the abort near-certain without the hook: after its forward, rank 1 runs ``--busy-ms`` of pure
Python with a switch interval longer than that, so it keeps the GIL (a busy host does the same by not
scheduling the gloo worker); a gloo worker that has to release a finished work then waits for the GIL
until the interpreter finalizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


_KEPT: list = []  # --style global: the model outlives the run, as a module-level `model = ...` does


def _idle_gloo_workers() -> int:
    """SCHED_IDLE for this process's gloo worker threads: they run only while the main thread is off the CPU
    (a loaded host, made repeatable). Returns how many there are."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                n += 1
    return n


def _forward(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model("flux2").eval()
    inputs = tiny_inputs("flux2", model, batch=1, text_len=8, image_hw=(4, 4), ragged_text=False)
    model.set_attention_backend(args.backend)
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=dist.get_world_size()))
    if rank == 1 and args.idle_workers and not _idle_gloo_workers():
        raise RuntimeError("no gloo worker thread found (pt_gloo_runloop)")
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    if rank == 0:
        assert torch.isfinite(out).all()  # rank 0 reads its output; rank 1 never does
    if args.style == "global":
        _KEPT.append(model)


def _rank(rank: int, init_file: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if rank == 1 and args.one_cpu:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before the gloo threads exist: they inherit it
    if rank == 1 and args.switch_s:
        sys.setswitchinterval(args.switch_s)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        _forward(rank, args)
        if rank == 1 and args.hold_gil_ms:
            import ctypes

            ctypes.PyDLL(None).usleep(int(args.hold_gil_ms * 1000))  # a C call that keeps the GIL
    finally:
        if args.style in ("harness", "global"):
            dist.destroy_process_group()
        if os.environ.get("EXIT_TRACE"):
            print(f"[rank {rank}] {time.monotonic():.6f} pid {os.getpid()} leaves", file=sys.stderr, flush=True)


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else f"exit {code}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--backend", default="ulysses_sdpa")
    parser.add_argument("--style", choices=("script", "harness", "global"), default="script")
    parser.add_argument("--hold-gil-ms", type=float, default=50.0)
    parser.add_argument("--one-cpu", type=int, default=1)
    parser.add_argument("--switch-s", type=float, default=10.0)
    parser.add_argument("--idle-workers", type=int, default=1)
    parser.add_argument("--no-exit-hook", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # before any fork: no intra-op pool for the children to inherit
    import sp_diffusers
    import sp_diffusers.tiny  # imported once here, not in every rank

    sp_diffusers.install()
    if args.no_exit_hook:
        from sp_diffusers import exit_hook

        exit_hook.unregister()

    # no `with`/`finally` around the forks: a child's sys.exit unwinds through them and would run the
    # parent's cleanup
    tmp = tempfile.mkdtemp(prefix="sp-exit-")
    ended: list[list[str]] = []
    for pair in range(args.pairs):
        init_file = os.path.join(tmp, f"rendezvous-{pair}")
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _rank(rank, init_file, args)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                sys.exit(code)  # unwinds to the top: the interpreter finalizes as after a script
            pids.append(pid)
        ended.append([_ended(os.waitpid(pid, 0)[1]) for pid in pids])
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"ended": ended}), flush=True)


if __name__ == "__main__":
    main()
