"""Which rollout samples an update trains on: flow_grpo's zero-advantage filter, made safe for dp and SP.

flow_grpo drops the samples whose advantage is 0 at every timestep (in practice: prompt groups whose rewards
are all equal, which carry no policy gradient but dilute the mean) before its update, then flips randomly chosen
dropped samples back in until the kept count divides ``num_batches_per_epoch``. Run naively under data
parallelism, each rank would keep a different count, run a different number of micro-batches, and FSDP's
collectives (one all-gather / reduce-scatter per block and micro-batch) would pair up wrongly or hang.

So the count is agreed without a collective: every rank holds the advantages of *all* dp ranks (they are
computed from the all-gathered rewards), so every rank computes every rank's number of non-zero samples and
takes the same ``K = max`` over ranks, rounded up to a multiple of ``mini_batches`` (flow_grpo's divisibility)
and capped at the rank's sample count. A rank with fewer non-zero samples tops up with zero-advantage ones,
chosen by a generator seeded from the batch (identical on SP peers, which share the batch), as flow_grpo tops
up. ``K = 0`` everywhere: no update on any rank. The SP group's ranks see identical advantages, so they keep
identical samples.
"""

from __future__ import annotations

import torch

__all__ = ["kept_samples"]


def kept_samples(
    advantages_all: torch.Tensor,
    dp_rank: int,
    dp_size: int,
    mini_batches: int,
    seed: int,
) -> torch.Tensor:
    """Sorted local indices ``[K]`` of the samples this dp rank trains on (the same K on every rank).

    Args:
        advantages_all: ``[dp_size * B]`` the advantages of every dp rank's samples, rank-major (as gathered).
        dp_rank, dp_size: this rank's data-parallel position and the data-parallel degree.
        mini_batches: optimizer steps per update; K is a multiple of it where the samples allow.
        seed: seeds the choice of zero-advantage samples that top a rank up to K.
    """
    if advantages_all.ndim != 1 or advantages_all.numel() % dp_size:
        raise ValueError(
            f"kept_samples: advantages_all must be 1-D with dp_size ({dp_size}) x B entries, got shape "
            f"{tuple(advantages_all.shape)}; pass the advantages of every dp rank, gathered rank-major"
        )
    per_rank = advantages_all.detach().cpu().reshape(dp_size, -1)
    b = per_rank.shape[1]
    nonzero = per_rank != 0
    k = int(nonzero.sum(dim=1).max())
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    k = min(b, -(-k // mini_batches) * mini_batches)
    mine = nonzero[dp_rank]
    keep = torch.nonzero(mine).flatten()
    missing = k - keep.numel()
    if missing > 0:
        zeros = torch.nonzero(~mine).flatten()
        pick = torch.randperm(zeros.numel(), generator=torch.Generator().manual_seed(seed))[:missing]
        keep = torch.cat([keep, zeros[pick]])
    return keep.sort().values
