"""The parallel degrees, validated once, and one DeviceMesh ``(dp, ring, ulysses)`` built from them.

diffusers looks its context-parallel groups up by the dim names ``ring`` and ``ulysses``; FSDP2 and
the data loader use ``dp`` (and the whole mesh for sharding). dp = world / (ring * ulysses).
:class:`ParallelDims` is the only place degrees are checked: every caller builds one.

HSDP: ``replicate = R`` splits the world into R replica groups of ``world / R`` consecutive ranks (a node
under torchrun), each holding ``dp / R`` whole SP groups; FSDP shards within a replica group and replicates
across them (``engine/sharding.py`` builds its ``(replicate, shard)`` mesh from this one). dp stays
world / (ring * ulysses): R of the replicas times ``dp / R`` within.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp", "ring", "ulysses")

__all__ = [
    "MESH_DIM_NAMES",
    "MeshError",
    "ParallelDims",
    "build_device_mesh",
    "default_device_type",
]


class MeshError(ValueError):
    """A mesh or degree that cannot work; the message suggests valid values."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Sequence-parallel degrees (and HSDP's replica groups) over a world of ``world`` ranks; raises
    :class:`MeshError` when they cannot work (the message names the degree, its value and the valid choices)."""

    world: int
    ulysses: int = 1
    ring: int = 1
    replicate: int = 1  # HSDP replica groups (dp_replicate); 1: FSDP shards over the whole world

    def __post_init__(self) -> None:
        self.check_degrees(self.ulysses, self.ring)
        if not isinstance(self.replicate, int) or isinstance(self.replicate, bool) or self.replicate < 1:
            raise MeshError(
                f"dp_replicate must be a positive int, got {self.replicate!r}; fix: dp_replicate=1"
            )
        if self.world % self.sp:
            valid = ", ".join(str(d) for d in _divisors(self.world))
            raise MeshError(
                f"ulysses_degree * ring_degree = {self.ulysses} * {self.ring} = {self.sp} does not divide the "
                f"world size {self.world}; fix: pick a sequence-parallel degree among {valid} "
                f"(or launch a multiple of {self.sp} processes)"
            )
        if self.dp % self.replicate:
            # each replica group must hold whole SP groups: a sequence never spans two replicas (nodes)
            valid = ", ".join(str(d) for d in _divisors(self.dp))
            raise MeshError(
                f"dp_replicate={self.replicate} does not divide the data-parallel size dp = world / (ulysses * "
                f"ring) = {self.world} / {self.sp} = {self.dp}, so a replica group of world / dp_replicate ranks "
                f"would not hold whole sequence-parallel groups; fix: pick dp_replicate among {valid} (1: plain "
                f"FSDP over all ranks), or launch dp_replicate * ulysses * ring * k processes"
            )

    @staticmethod
    def check_degrees(ulysses: object, ring: object) -> None:
        """Each degree must be a positive int."""
        for name, value in (("ulysses_degree", ulysses), ("ring_degree", ring)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def of_process_group(cls, ulysses: int = 1, ring: int = 1, replicate: int = 1) -> ParallelDims:
        """The degrees over the default process group (a world of one when it is not initialised)."""
        distributed = dist.is_available() and dist.is_initialized()
        return cls(dist.get_world_size() if distributed else 1, ulysses, ring, replicate)

    @property
    def sp(self) -> int:
        """Ranks that share one sequence: ulysses x ring."""
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all (replicas x shards of dp): world / sp."""
        return self.world // self.sp

    @property
    def shard(self) -> int:
        """Ranks one parameter is sharded over: the whole world, or one replica group's world / replicate."""
        return self.world // self.replicate

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """A ``(dp, ring, ulysses)`` mesh over the default process group.

        Ulysses ranks are adjacent (``ulysses`` is the fastest-varying dim), so an SP group stays inside a node
        when the degree divides the GPUs per node. Every rank must call this (it creates sub-groups).
        """
        _require_process_group()
        if dist.get_world_size() != self.world:
            raise MeshError(
                f"ParallelDims has world={self.world} but the process group has {dist.get_world_size()} ranks"
            )
        return init_device_mesh(
            device_type or default_device_type(),
            (self.dp, self.ring, self.ulysses),
            mesh_dim_names=MESH_DIM_NAMES,
        )


def _require_process_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "torch.distributed is not initialised; fix: launch with torchrun and call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl') first"
        )


def default_device_type() -> str:
    """``cuda`` when this process has a GPU, else ``cpu`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_device_mesh(
    ulysses_degree: int, ring_degree: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """A ``(dp, ring, ulysses)`` mesh over the default process group (see :meth:`ParallelDims.build_mesh`)."""
    _require_process_group()
    return ParallelDims.of_process_group(ulysses_degree, ring_degree).build_mesh(device_type)
