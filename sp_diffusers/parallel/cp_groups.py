"""Reading diffusers' ``ParallelConfig``: its context-parallel config, the degrees and the process groups.

diffusers hands every attention processor and backend a ``ParallelConfig`` whose ``context_parallel_config``
(after ``enable_parallelism``) carries the Ulysses and ring degrees and the meshes it set up. This is the one
place that knows those attribute names; everything else asks here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .gathers import gather_ints

__all__ = ["CPGroups", "cp_config_of", "cp_degrees", "cp_groups", "cp_world", "stream_sizes"]


def cp_config_of(parallel_config: Any) -> Any | None:
    """The ``ContextParallelConfig`` inside ``parallel_config`` (None without context parallelism)."""
    if parallel_config is None:
        return None
    return getattr(parallel_config, "context_parallel_config", None)


def cp_degrees(parallel_config: Any) -> tuple[int, int]:
    """``(ulysses_degree, ring_degree)``; ``(1, 1)`` without context parallelism."""
    cp = cp_config_of(parallel_config)
    if cp is None:
        return 1, 1
    return int(cp.ulysses_degree), int(cp.ring_degree)


def cp_world(parallel_config: Any) -> int:
    """Number of sequence shards: ulysses x ring (1 without context parallelism)."""
    ulysses, ring = cp_degrees(parallel_config)
    return ulysses * ring


@dataclass(frozen=True)
class CPGroups:
    """The process groups of one context-parallel layout (diffusers shards ring-major, Ulysses-minor).

    ``cp_group`` spans all ``ulysses * ring`` ranks of one sequence (the Ulysses group when ring = 1);
    ``ring_group`` is None when ring = 1.
    """

    ulysses: int
    ring: int
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup | None
    cp_group: dist.ProcessGroup
    anything: bool  # diffusers' ulysses_anything: ranks may hold different local lengths

    @property
    def world(self) -> int:
        return self.ulysses * self.ring

    @property
    def ring_rank(self) -> int:
        return dist.get_rank(self.ring_group) if self.ring_group is not None else 0

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group)


def cp_groups(parallel_config: Any) -> CPGroups | None:
    """The groups of ``parallel_config``'s context parallelism, or None without it (or at degree 1)."""
    cp = cp_config_of(parallel_config)
    ulysses, ring = cp_degrees(parallel_config)
    if cp is None or ulysses * ring == 1:
        return None
    ulysses_group = cp._ulysses_mesh.get_group()
    ring_group = cp._ring_mesh.get_group() if ring > 1 else None
    cp_group = cp._flattened_mesh.get_group() if ring > 1 else ulysses_group
    return CPGroups(
        ulysses, ring, ulysses_group, ring_group, cp_group, bool(getattr(cp, "ulysses_anything", False))
    )


def stream_sizes(parallel_config: Any, counts: list[int], device: torch.device) -> list[list[int]]:
    """Every context-parallel rank's local lengths of the streams (``counts`` = this rank's), one list per
    stream; ``[[c] for c in counts]`` without context parallelism. One small all-gather."""
    groups = cp_groups(parallel_config)
    if groups is None:
        return [[c] for c in counts]
    table = gather_ints(counts, groups.cp_group, device)
    return [[row[i] for row in table] for i in range(len(counts))]
