"""Run a function on N real processes (gloo), collect what each rank returns, never hang.

Ranks start from a fork server that has imported torch, diffusers and transformers once (a fresh interpreter
spends seconds importing them, and the suite starts hundreds of ranks); each rank is still its own process,
with no process group, no installed patches and the environment of the test that starts it. Ranks that must
import another diffusers (``sys_path``: the compatibility matrix) start from a fork server of their own, one per
``sys_path``, which imported that diffusers (``SP_TEST_MATRIX_SPAWN=1``: from fresh interpreters instead).

The backend and device come from the environment (``SP_TEST_BACKEND``, ``SP_TEST_DEVICE``; gloo and the CPU
by default, which is what CI runs): see :func:`backend_and_device`.

Workers are named ``"package.module:function"`` and imported in the child after ``sys_path`` entries are
prepended, so a child can run against another diffusers version (the compatibility matrix) than the
parent pytest process has imported. Every collective runs under the process-group timeout, and the
parent kills all ranks when the whole run exceeds ``timeout``.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import os
import pickle
import queue
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp


class DistributedFailure(AssertionError):
    pass


def backend_and_device():
    """The process-group backend and the device of the ranks: ``SP_TEST_BACKEND`` (default gloo) and
    ``SP_TEST_DEVICE`` (default cpu; ``cuda`` puts rank r on GPU r mod the GPU count). Workers that create
    tensors on purpose read the device from :func:`rank_device`."""
    import torch

    return os.environ.get("SP_TEST_BACKEND", "gloo"), torch.device(os.environ.get("SP_TEST_DEVICE", "cpu"))


def rank_device():
    """The device a worker's tensors go on (``SP_TEST_DEVICE``; the current GPU for ``cuda``)."""
    import torch

    device = backend_and_device()[1]
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


# What the fork server imports before it forks ranks: only libraries (no sp_diffusers, no state); lazy
# diffusers classes are resolved so that a rank finds them imported.
PRELOAD = "tests._preload"


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


_SERVERS: dict[tuple[str, ...], Any] = {}


def _server_for(sys_path: Sequence[str]) -> Any:
    """The fork server of one ``sys_path`` (started once per pytest process, alive until it exits): it imports
    PRELOAD with ``sys_path`` in front, so its ranks find that diffusers imported."""
    from multiprocessing import forkserver

    key = tuple(sys_path)
    if key not in _SERVERS:
        server = forkserver.ForkServer()
        server.set_forkserver_preload([PRELOAD])
        # the server is a fresh interpreter with this process's environment (Python 3.11's fork server drops
        # the sys.path it is given): PRELOAD puts SP_TEST_SYS_PATH in front
        saved = os.environ.get("SP_TEST_SYS_PATH")
        os.environ["SP_TEST_SYS_PATH"] = os.pathsep.join(key)
        try:
            server.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("SP_TEST_SYS_PATH")
            else:
                os.environ["SP_TEST_SYS_PATH"] = saved
        _SERVERS[key] = server
    return _SERVERS[key]


@contextlib.contextmanager
def _starting_from(sys_path: Sequence[str]):
    """Processes started inside come from ``sys_path``'s fork server, not the default one.

    multiprocessing has one fork server per process and asks it by a module-level function, which is pointed at
    this one while ranks start (they start one by one, from this thread)."""
    if not sys_path:
        yield
        return
    from multiprocessing import forkserver

    saved = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = _server_for(sys_path).connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = saved


def _child(
    rank: int, world: int, init_file: str, target: str, args: tuple, sys_path: Sequence[str], env: dict, q
) -> None:
    # a native crash (SIGSEGV, abort) writes every thread's Python stack here; the parent reports it
    crash_log = open(_crash_log(init_file, rank), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(crash_log, all_threads=True)
    for p in reversed(sys_path):
        sys.path.insert(0, p)
    # a forked rank has the fork server's environment: take the starting test's, as a spawned rank would
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        # SP_TEST_REF_THREADS: the intra-op threads of single-process references (a different fp32 summation
        # order than the parallel runs they are compared with; the tolerances must absorb it)
        threads = os.environ.get("SP_TEST_REF_THREADS") if world == 1 else None
        torch.set_num_threads(int(threads or os.environ.get("SP_TEST_THREADS", "1")))
        backend, device = backend_and_device()
        if device.type == "cuda":
            # ranks beyond the visible GPUs share them (gloo ranks sharing cuda:0; NCCL refuses that)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=float(os.environ.get("SP_TEST_COLLECTIVE_TIMEOUT", "120"))),
        )
        module, func = target.split(":")
        result = getattr(importlib.import_module(module), func)(rank, world, *args)
        # plain pickle stores tensors by value; the queue's own pickler would pass shared-memory handles that
        # die with this process
        q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _crash_log(init_file: str, rank: int) -> str:
    return f"{init_file}.rank{rank}.crash"


def _crash_report(init_file: str, ranks: Sequence[int]) -> str:
    """The Python stacks that dead ranks' fault handlers wrote (empty where a rank wrote none)."""
    parts = []
    for r in ranks:
        with contextlib.suppress(OSError), open(_crash_log(init_file, r)) as f:
            if text := f.read().strip():
                parts.append(f"--- rank {r} fault handler:\n{text}")
    return "\n".join(parts)


def run_distributed(
    target: str,
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    sys_path: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` processes; return per-rank results."""
    spawn = bool(sys_path) and os.environ.get("SP_TEST_MATRIX_SPAWN") == "1"
    ctx = mp.get_context("spawn") if spawn else _context()
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, init_file, target, args, list(sys_path), {**os.environ, **(env or {})}, q),
                daemon=True,
            )
            for r in range(world_size)
        ]
        with _starting_from(() if spawn else sys_path):
            for p in procs:
                p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(results) + len(errors) < world_size:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    if errors:
                        break  # peers of a failed rank are stuck in a collective; report the failure
                    raise DistributedFailure(
                        f"{target} on {world_size} ranks did not finish within {timeout:.0f}s "
                        f"(finished ranks: {sorted(results) + sorted(errors)})"
                    )
                try:
                    rank, status, payload = q.get(timeout=min(remaining, 5.0))
                except queue.Empty:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    missing = [i for i in dead if i not in results and i not in errors]
                    if missing:
                        raise DistributedFailure(
                            f"rank(s) {missing} of {target} died (exit codes "
                            f"{[procs[i].exitcode for i in missing]})\n{_crash_report(init_file, missing)}"
                        ) from None
                    continue
                (results if status == "ok" else errors)[rank] = (
                    pickle.loads(payload) if status == "ok" else payload
                )
                if status != "ok":
                    deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=15))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        # every failed rank, the first to report first: a peer of the failing rank often fails too, later, in a
        # collective ("Connection closed by peer"), and the lowest rank is not necessarily the cause
        report = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in errors.items())
        raise DistributedFailure(
            f"{target}: rank(s) {list(errors)} failed (in the order they reported):\n{report}"
        )
    return [results[r] for r in range(world_size)]
