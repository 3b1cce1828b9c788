"""LoRA adapters start from one seeded draw (``LoraSettings.seed``): every rank of a run draws the same adapters
whatever its global RNG holds (data-parallel replicas must start equal: nothing broadcasts them), a run repeats, and
the caller's random stream is left as it was. Before the seed, each rank drew from its own unseeded global RNG."""

from __future__ import annotations

import pytest
import torch

from sp_diffusers.engine import FSDPEngine
from sp_diffusers.engine.settings import EngineSettings, LoraSettings
from sp_diffusers.tiny import tiny_model


def _adapters(global_seed: int, lora: LoraSettings) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(global_seed)  # another process's global RNG
    state = torch.get_rng_state()
    engine = FSDPEngine(tiny_model("qwenimage", num_layers=1, seed=0), EngineSettings(lora=lora))
    if lora.seed is not None:
        assert torch.equal(torch.get_rng_state(), state), "building the adapters moved the caller's RNG"
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora_" in n}, state


@pytest.mark.parametrize("init", [False, "gaussian"], ids=["random_A_and_B", "gaussian"])
def test_adapters_are_the_same_draw_whatever_the_global_rng(init):
    a, _ = _adapters(1, LoraSettings(init=init, seed=7))
    b, _ = _adapters(99, LoraSettings(init=init, seed=7))
    c, _ = _adapters(1, LoraSettings(init=init, seed=8))
    assert a and a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    moved = [n for n in a if "lora_A" in n]  # B starts at 0 under gaussian: A carries the draw
    assert moved and all(not torch.equal(a[n], c[n]) for n in moved)


def test_unseeded_adapters_follow_the_global_rng():
    a, _ = _adapters(1, LoraSettings(init=False, seed=None))
    b, _ = _adapters(2, LoraSettings(init=False, seed=None))
    assert any(not torch.equal(a[n], b[n]) for n in a)
