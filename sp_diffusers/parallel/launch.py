"""Joining the process group a launcher (torchrun, ``accelerate launch``) describes in the environment."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "lost_peer", "record_peers"]


def init_distributed(timeout_s: float = 600.0, required_by: str | None = None) -> None:
    """Join the process group (NCCL with a GPU, else gloo); a no-op when joined already or not launched.

    ``required_by``: a command that cannot run without a launcher; then a missing ``RANK`` is an error that
    shows the torchrun form of it.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        if required_by:
            raise SystemExit(
                f"{required_by} runs under torchrun, e.g.: torchrun --nproc_per_node 2 -m sp_diffusers.cli "
                f"{required_by}"
            )
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    # Under torchrun the store outlives a restart; gloo then reads the dead attempt's peer addresses and
    # fails to connect ("connectFullMesh ... Connection refused"). A per-attempt key prefix isolates them.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    store = dist.PrefixStore(f"sp_diffusers/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


_PEERS: list[tuple[str, int]] = []  # every rank's (host, pid), from record_peers
_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def record_peers() -> None:
    """Learn every rank's host and process id (one small all-gather), so that a rank that dies later is named."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    import socket

    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    _PEERS[:] = peers


def _gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended (a zombie its launcher has not reaped yet counts); False where
    the system has no ``/proc`` to ask."""
    if not os.path.isdir("/proc"):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False


def lost_peer(err: BaseException) -> str | None:
    """For a collective that failed because another rank's process is gone: which rank (where this host can tell);
    None for any other error."""
    if not any(s in str(err) for s in _LOST):
        return None
    import socket
    import time

    host = socket.gethostname()
    local = [(rank, pid) for rank, (h, pid) in enumerate(_PEERS) if h == host and pid != os.getpid()]
    dead: list[int] = []
    for _ in range(30):  # a killed process closes its sockets before it is done exiting: give it 3 s
        dead = [rank for rank, pid in local if _gone(pid)]
        if dead:
            break
        time.sleep(0.1)
    if dead:
        return f"rank {', '.join(map(str, dead))} stopped mid-run (its process is gone)"
    return "another rank stopped mid-run (a collective lost its connection to it)"
