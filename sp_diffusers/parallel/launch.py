"""Joining the process group a launcher (torchrun, ``accelerate launch``) describes in the environment."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed"]


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
