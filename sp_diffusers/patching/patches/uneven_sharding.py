"""diffusers' context-parallel sharder refuses sequence lengths that do not divide the degree.

Defect: ``EquipartitionSharder.shard`` asserts ``tensor.size(dim) % mesh.size() == 0`` and fails with a bare
``AssertionError: Tensor size along dimension to be sharded must be divisible by mesh size`` that names
neither the input nor the fix: a prompt of 7 tokens at SP = 2, a video whose frames x height x width is odd,
any aspect ratio that leaves a remainder. Its gather (``EquipartitionSharder.unshard``) returns an
``AsyncCollectiveTensor`` that ``torch.save`` cannot pickle. (The SIGABRT at interpreter exit of a rank that
never reads its output is not this gather's doing, nor fixed by replacing it: any gloo collective whose worker
thread drops the finished work after the caller can cause it - the output all-gather and the attention
all-to-all alike; ``sp_diffusers.parallel.exit_hook`` ends it.) diffusers' own way out, ``ulysses_anything`` (0.37+),
shards unevenly but its gather all-gathers tensors of different sizes, which gloo refuses, and its attention
backward raises ``NotImplementedError``: inference only.
Affected: every release with context parallelism, 0.36-0.42. Upstream: none (the sharder's own comment says
the uneven case "has not yet been tested/required for any model").
Fix: ``shard`` splits a length that does not divide the degree the way ``torch.tensor_split`` does (the
first ``S % P`` ranks hold one token more; diffusers' ``ulysses_anything`` split is the same), and refuses a
length shorter than the degree with the shape and the fix. ``unshard`` (and ``unshard_anything``) gather
pieces of any length into a plain tensor: lengths exchanged, pieces padded to the longest and cut back, and
a backward that gives each rank the gradient of its own piece, as diffusers' gather does for equal pieces.
``ulysses_sdpa`` (and ``native`` through the ``native_ulysses`` patch) attends over uneven shards exactly.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "uneven_sharding"
AFFECTED = "0.36-0.42"
UPSTREAM = "none filed (hooks/context_parallel.py EquipartitionSharder)"

_swaps = AttributeSwaps()


def _module():
    from diffusers.hooks import context_parallel

    return context_parallel


def probe() -> Probe:
    shard = inspect.getsource(_module().EquipartitionSharder.shard)
    if "divisible" in shard or "% mesh.size()" in shard:
        return Probe(True, "EquipartitionSharder.shard asserts that every split length divides the degree")
    return Probe(False, "the sharder splits lengths that do not divide the degree")


class _GatherPieces(torch.autograd.Function):
    """Forward: every rank's piece along ``dim``, in rank order (pieces may differ in length). Backward: the
    gradient of this rank's piece (each rank computes the whole loss from the whole output)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, group: dist.ProcessGroup):  # type: ignore[override]
        from ...parallel.agreement import piece_sizes
        from ...parallel.gathers import all_gather_along

        # every rank's piece length: known to the model forward's scope (no collective), else exchanged
        sizes = piece_sizes(group, tensor.shape[dim], tensor.device)
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), sizes[rank]
        return all_gather_along(tensor, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None


def shard(cls, tensor: torch.Tensor, dim: int, mesh) -> torch.Tensor:
    world, n = mesh.size(), tensor.size(dim)
    if n < world:
        raise ValueError(
            f"a context-parallel plan input of shape {tuple(tensor.shape)} has {n} positions along dim {dim}, "
            f"fewer than the {world} sequence-parallel ranks; fix: lower the degree to at most {n}, or pad "
            "that input (sp_diffusers.parallel.padding for text)"
        )
    return tensor.tensor_split(world, dim=dim)[dist.get_rank(mesh.get_group())]


def unshard(cls, tensor: torch.Tensor, dim: int, mesh) -> torch.Tensor:
    return _GatherPieces.apply(tensor.contiguous(), dim % tensor.dim(), mesh.get_group())


def apply() -> None:
    if _swaps.active:
        return
    mod = _module()
    _swaps.set(mod.EquipartitionSharder, "shard", classmethod(shard))
    _swaps.set(mod.EquipartitionSharder, "unshard", classmethod(unshard))
    anything = getattr(mod, "PartitionAnythingSharder", None)
    if anything is not None:  # 0.37+: ulysses_anything's gather has the same job
        _swaps.set(anything, "unshard_anything", classmethod(unshard))
    logger.info("patched EquipartitionSharder: any sequence length shards and gathers (tensor_split rule)")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
