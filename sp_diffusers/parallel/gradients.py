"""Exact gradients under sequence parallelism without ``FSDPEngine``: one call after ``backward()``.

Under context parallelism every rank of an SP group computes the loss of the whole (gathered) output, but
its parameter gradients cover only its own sequence shard: they are partial. Their SUM over the SP group is
the single-process gradient. ``FSDPEngine`` makes this exact by itself; a training loop of your own (plain,
DDP, FSDP, accelerate) calls :func:`sync_sp_gradients` after ``backward()``. With DDP/FSDP over a mesh that
includes the SP ranks, their MEAN over all ``dp x sp`` ranks gives 1/sp of the data-parallel gradient
instead: there, multiply the loss by ``sp_degree(model)`` (or set FSDP2's gradient divide factor to dp, as
``FSDPEngine`` does) and skip this call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cp_groups import cp_groups
from .ledger import comm_kind

__all__ = ["sp_degree", "sync_sp_gradients"]


def sp_degree(model: torch.nn.Module) -> int:
    """The number of ranks sharing one sequence (ulysses x ring) after ``enable_parallelism``; 1 before."""
    groups = cp_groups(getattr(model, "_parallel_config", None))
    return groups.world if groups is not None else 1


def sync_sp_gradients(model: torch.nn.Module) -> int:
    """Sum every parameter's gradient over the model's SP group (in place), so each rank holds the
    single-process gradient. One flattened all-reduce per dtype; returns the number of tensors summed.

    Every rank of the group must call it, after the same backward. A parameter without a gradient on some
    rank takes part as zeros, so ranks never wait on one another.
    """
    groups = cp_groups(getattr(model, "_parallel_config", None))
    if groups is None:
        raise ValueError(
            f"{type(model).__name__} has no context parallelism enabled (sp degree 1): its gradients are already "
            "complete; fix: call sync_sp_gradients after model.enable_parallelism(config=...), or not at all"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        with comm_kind("grad_reduce"):
            dist.all_reduce(flat, group=groups.cp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(params)
