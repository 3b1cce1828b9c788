"""One DeviceMesh ``(dp, ring, ulysses)`` for data and sequence parallelism.

diffusers looks its context-parallel groups up by the dim names ``ring`` and ``ulysses``; FSDP2 and
the data loader use ``dp`` (and the whole mesh for sharding). dp = world / (ring * ulysses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp", "ring", "ulysses")

__all__ = ["MESH_DIM_NAMES", "MeshError", "build_device_mesh", "default_device_type", "validate_degrees"]


class MeshError(ValueError):
    """A mesh or degree that cannot work; the message suggests valid values."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_degrees(world_size: int, ulysses_degree: int, ring_degree: int = 1) -> int:
    """Check the degrees against the world size; return the data-parallel degree."""
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MeshError(f"{name} must be a positive int, got {value!r}")
    sp = ulysses_degree * ring_degree
    if world_size % sp:
        valid = ", ".join(str(d) for d in _divisors(world_size))
        raise MeshError(
            f"ulysses_degree * ring_degree = {ulysses_degree} * {ring_degree} = {sp} does not divide the "
            f"world size {world_size}; fix: pick a sequence-parallel degree among {valid} "
            f"(or launch a multiple of {sp} processes)"
        )
    return world_size // sp


def default_device_type() -> str:
    """``cuda`` when this process has a GPU, else ``cpu`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_device_mesh(
    ulysses_degree: int, ring_degree: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """A ``(dp, ring, ulysses)`` mesh over the default process group.

    Ulysses ranks are adjacent (``ulysses`` is the fastest-varying dim), so an SP group stays inside a node
    when the degree divides the GPUs per node. Every rank must call this (it creates sub-groups).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "torch.distributed is not initialised; fix: launch with torchrun and call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl') first"
        )
    world = dist.get_world_size()
    dp = validate_degrees(world, ulysses_degree, ring_degree)
    return init_device_mesh(
        device_type or default_device_type(),
        (dp, ring_degree, ulysses_degree),
        mesh_dim_names=MESH_DIM_NAMES,
    )
