"""Helpers shared by the distributed test workers (imported inside spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def ulysses_parallel_config(ulysses_degree: int, ring_degree: int = 1, mesh=None):
    """A real diffusers ``ParallelConfig`` set up the way ``enable_parallelism`` does, without a model."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    if mesh is None:
        mesh = init_device_mesh("cpu", (ring_degree, ulysses_degree), mesh_dim_names=("ring", "ulysses"))
    cp = ContextParallelConfig(ulysses_degree=ulysses_degree, ring_degree=ring_degree)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    return config


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|; tensors of different shapes are infinitely apart, empty ones of one shape agree."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def shard(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim``: ``tensor_split``, diffusers' and sp-diffusers' rule for
    lengths that do not divide the degree (equal to ``chunk`` when they do)."""
    return x.tensor_split(world, dim=dim)[rank]


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient (zeros where it has none), flattened into one vector in parameter order."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in model.parameters()
        ]
    )


def summed_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient (zeros where it has none), summed over the process group: the gradient
    contract of sequence parallelism. One all-reduce of them all, flattened: a call per parameter waits on every
    rank's scheduling once per parameter (seconds for a 40-block model on oversubscribed gloo ranks)."""
    flat = flat_grads(model)
    dist.all_reduce(flat)
    params = list(model.parameters())
    return [
        piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in params]), params, strict=True)
    ]
