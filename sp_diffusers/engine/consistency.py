"""SP peers must see the same data: a cheap checksum, compared across the SP group in one collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import collective_device, to_device

__all__ = ["SPDivergenceError", "checksum", "verify_sp_consistency"]


class SPDivergenceError(RuntimeError):
    """SP peers hold different batches, noise or parameters: their gradients would be silently wrong."""


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two float64 numbers that change when any element changes or moves: the sum and a position-weighted sum."""
    x = t.detach().to(torch.float64).flatten()
    if x.numel() == 0:
        return x.new_zeros(2)
    weights = torch.cos(torch.arange(x.numel(), device=x.device, dtype=torch.float64) * 0.618)
    return torch.stack([x.sum(), (x * weights).sum()])


def _flatten(tensors: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    items = []
    for key in sorted(tensors):
        value = tensors[key]
        if torch.is_tensor(value):
            items.append((key, value))
        elif isinstance(value, (list, tuple)):
            items.extend((f"{key}[{i}]", v) for i, v in enumerate(value) if torch.is_tensor(v))
    return items


def verify_sp_consistency(tensors: dict[str, Any], group: dist.ProcessGroup, what: str = "batch") -> None:
    """Raise ``SPDivergenceError`` naming the first tensor whose checksum differs across ``group``."""
    items = _flatten(tensors)
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    # names (and shapes) first: peers with different keys would otherwise all-gather tensors of different
    # sizes, which gloo aborts on and NCCL may hang on
    layouts: list = [None] * world
    dist.all_gather_object(layouts, [(name, tuple(t.shape), str(t.dtype)) for name, t in items], group=group)
    if any(layout != layouts[0] for layout in layouts):
        mine = {n: (s, d) for n, s, d in layouts[0]}
        for r, layout in enumerate(layouts[1:], start=1):
            theirs = {n: (s, d) for n, s, d in layout}
            if theirs != mine:
                only_0 = sorted(set(mine) - set(theirs))
                only_r = sorted(set(theirs) - set(mine))
                changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
                raise SPDivergenceError(
                    f"SP peers disagree on the {what}'s keys or shapes: rank {ranks[0]} vs rank {ranks[r]}: only on "
                    f"rank {ranks[0]}: {only_0}, only on rank {ranks[r]}: {only_r}, other shape/dtype: {changed}. "
                    "Every rank of an SP group must run on the same micro-batch; fix: build the batch from the "
                    "data-parallel rank, or let FSDPEngine.prepare_batch broadcast it"
                )
    if not items:
        return
    device = collective_device(group)
    local = torch.stack([to_device(checksum(t), device) for _, t in items])  # [N, 2], on the group's device
    gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))  # rank-major rows (gloo's form)
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.cpu().unflatten(
        0, (world, -1)
    )  # a debug check: one transfer for every tensor's checksums
    for i, (name, _) in enumerate(items):
        values = list(gathered[:, i])
        differing = [ranks[r] for r, v in enumerate(values) if not torch.equal(v, values[0])]
        if differing:
            raise SPDivergenceError(
                f"SP peers disagree on {what} '{name}': ranks {differing} differ from rank {ranks[0]} "
                f"(checksums {[v.tolist() for v in values]}). Every rank of an SP group must run on the same "
                "micro-batch, noise and timesteps; fix: derive them from the data-parallel rank (not the global "
                "rank), or let FSDPEngine.prepare_batch broadcast them from the SP group's first rank"
            )
