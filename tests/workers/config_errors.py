"""Bad configurations raise a clear error on every rank, and no rank hangs (a barrier follows)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def config_errors(rank: int, world: int) -> dict:
    import sp_diffusers

    sp_diffusers.install()
    cases = {
        "degree_exceeds_world": lambda: sp_diffusers.context_parallel_config(ulysses_degree=2 * world),
        "degree_not_dividing_world": lambda: sp_diffusers.context_parallel_config(
            ulysses_degree=world - 1 or 3
        ),
        "degree_zero": lambda: sp_diffusers.context_parallel_config(ulysses_degree=0),
        "degree_str": lambda: sp_diffusers.context_parallel_config(ulysses_degree="2"),
        "mesh_without_ulysses": lambda: sp_diffusers.context_parallel_config(
            ulysses_degree=world, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
        ),
        "mesh_size_mismatch": lambda: sp_diffusers.context_parallel_config(
            ulysses_degree=world // 2,
            mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")),
        ),
    }
    messages = {}
    for name, fn in cases.items():
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            messages[name] = str(err)
        else:
            messages[name] = None
    dist.barrier()
    return messages
