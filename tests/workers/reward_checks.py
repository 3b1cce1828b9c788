"""Reward scoring on real gloo ranks: one SP group of 2 (a stand-in engine: the group, the rank, the device)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def split_scoring(rank: int, world: int, module: str) -> dict:
    from sp_diffusers.flowgrpo.rewards.loading import load_callable, reward_specs
    from sp_diffusers.flowgrpo.rewards.scoring import RewardError, RewardSet

    engine = types.SimpleNamespace(sp_rank=rank, sp_size=world, sp_group=dist.group.WORLD, device=torch.device("cpu"))
    latents = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0))
    prompts = [f"p{i}" for i in range(5)]
    specs = reward_specs([{"fn": f"{module}:score", "input": "latents", "weight": 2.0}], "color")
    total = RewardSet(specs, lambda x: x, engine=engine)(latents, prompts).total
    calls = list(load_callable(f"{module}:score").__globals__["CALLS"])
    single = 2.0 * latents.flatten(1).mean(dim=1)
    failing = reward_specs([{"fn": f"{module}:rank1_fails", "input": "latents"}], "color")
    try:
        RewardSet(failing, lambda x: x, engine=engine)(latents, prompts)
        error = ""
    except RewardError as err:
        error = str(err)
    # each sample's features beside the scores (GARDO's): rank 0 computes 3 rows, rank 1 two, both get all five
    from sp_diffusers.flowgrpo.rewards.features import LatentFeatures

    scored = RewardSet(specs, lambda x: 2 * x, engine=engine, features=LatentFeatures())(latents, prompts)
    return {
        "total": total,
        "single": single.float(),
        "calls": calls,
        "error": error,
        "features": scored.features,
        "features_total": scored.total,
        "expected_features": (2 * latents).flatten(1).double(),
    }


def remote_scoring(rank: int, world: int, url: str) -> dict:
    """A url reward entry scored over the SP group: each rank posts its share of the samples to the server."""
    from sp_diffusers.flowgrpo.rewards.loading import reward_specs
    from sp_diffusers.flowgrpo.rewards.scoring import RewardSet

    engine = types.SimpleNamespace(sp_rank=rank, sp_size=world, sp_group=dist.group.WORLD, device=torch.device("cpu"))
    latents = torch.rand(5, 4, 3, generator=torch.Generator().manual_seed(0))
    specs = reward_specs([{"url": url, "input": "latents", "weight": 2.0, "kwargs": {"scale": 0.5}}], "color")
    total = RewardSet(specs, lambda x: x.unsqueeze(1), engine=engine)(latents, [f"p{i}" for i in range(5)]).total
    return {"total": total, "single": (latents.mean(dim=(1, 2)) * 0.5 * 2.0).float()}
