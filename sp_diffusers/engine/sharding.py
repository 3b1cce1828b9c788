"""FSDP2 sharding of a diffusers transformer on the engine's mesh, with the gradient contract made exact.

Plain FSDP (``dp_replicate = 1``): every parameter is sharded over all ``world = dp * ring * ulysses`` ranks
(a 1-D mesh, the whole ``(dp, ring, ulysses)`` mesh flattened). HSDP (``dp_replicate = R > 1``): the same ranks
as a 2-D mesh ``(replicate, shard) = (R, world / R)``, rank ``r`` at ``(r // (world / R), r % (world / R))``:
parameters are sharded over the ``world / R`` consecutive ranks of a replica group (a node under torchrun) and
replicated across the R groups. ``ParallelDims`` has checked that R divides dp, so a replica group holds
``dp / R`` whole SP groups and no sequence spans two of them.

The gradient contract. The ranks of an SP group share one micro-batch, and each one's parameter gradients cover
only its own sequence shard, so the correct reduction is a SUM over the SP group and a MEAN over the dp
data-parallel ranks (R replicas times dp / R within). FSDP2 sums over every rank it reduces across (the
reduce-scatter within a replica group, then under HSDP the all-reduce across the groups: world ranks in all)
and divides by the gradient divide factor; setting it to dp, not to the world, makes the result exact:
``sum over world / dp = SUM over sp, MEAN over dp``. With a factor set, FSDP2 reduce-scatters with
``PREMUL_SUM(1 / dp)`` (or ``AVG`` where the factor equals the shard group's size) and all-reduces with ``SUM``:
the division happens once, before the cross-replica sum. gloo has neither PREMUL_SUM nor AVG, so there both
collectives SUM and FSDP divides the reduced shard by dp afterwards (``set_force_sum_reduction_for_comms``):
exact on either backend, and the user never scales a loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.mesh import ParallelDims

__all__ = ["fully_shard_model", "sharding_mesh"]

SHARDING_DIM_NAMES = ("replicate", "shard")


def sharding_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """FSDP2's mesh over the engine's ``(dp, ring, ulysses)`` ``mesh``: 1-D ``fsdp`` (every rank) or, under HSDP,
    2-D ``(replicate, shard)`` of shape ``(dims.replicate, dims.shard)``. Collective: every rank calls it."""
    flat = mesh["dp", "ring", "ulysses"]._flatten("fsdp")
    if dims.replicate == 1:
        return flat
    # the flat mesh is in global-rank order (dp outermost), so consecutive blocks of world / R ranks are the
    # replica groups: each holds dp / R whole SP groups (ParallelDims checked that R divides dp)
    return flat._unflatten(0, (dims.replicate, dims.shard), SHARDING_DIM_NAMES)


def fully_shard_model(
    model: torch.nn.Module, mesh: DeviceMesh, dims: ParallelDims, mixed_precision: str | None
) -> DeviceMesh:
    """``fully_shard`` each block of ``model``'s ModuleLists, then the root, on :func:`sharding_mesh`; gradients
    reduced as the module docstring says. Returns the sharding mesh (1-D, or ``(replicate, shard)``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard_mesh = sharding_mesh(mesh, dims)
    kwargs: dict[str, Any] = {"mesh": shard_mesh}
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # SUM over the world's ranks, divided by dp (not by the world): SUM over SP, MEAN over data parallelism.
    # gloo has neither PREMUL_SUM nor AVG: reduce (and all-reduce) with SUM and let FSDP divide afterwards.
    sum_only = dist.get_backend() == "gloo"
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(dims.dp))
            module.set_force_sum_reduction_for_comms(sum_only)
    return shard_mesh
