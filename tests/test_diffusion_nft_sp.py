"""DiffusionNFT under sequence parallelism on real gloo ranks vs one process (tests/workers/nft_steps.py).

There is no ratio to be exactly 1 on-policy; instead the first update's loss, every gradient and every parameter
after the step equal the one-process run on the same data, at Ulysses 2 and at Ulysses 2 x Ring 2, full
fine-tuning and LoRA (with the KL to the adapters-off model). Tolerances (tests/_parity.py): gradients within
``1e-5 + 1e-4 |ref|`` and parameters within the AdamW step's Lipschitz bound of that (AdamW eps = lr = 1e-3), as
for Flow-GRPO: only the order of fp32 sums differs. The loss: fp64 arithmetic (the reference's adaptive weights
are doubles) on fp32 velocities, which differ between layouts by the rounding of reordered fp32 attention sums,
~1e-7 relative each; ``1e-6`` relative bounds their effect on the loss with room (measured: 4e-9 at SP 2, 7e-9
at Ulysses 2 x Ring 2, loss ~19), while a sharding bug (a token block missing or doubled) moves the velocities
by O(1) and the loss by O(1e-2) or more. The rollout (the old policy, dpm2, 6 steps) within
``1e-4`` of one process, as tests/test_engine.py holds Flow-GRPO's (fp32 attention over reordered blocks,
through six solver steps).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from ._dist import run_distributed
from ._parity import PARITY_EPS, PARITY_LR, worst_grad, worst_step

LAYOUTS = {"sp2": (2, 2, 1), "ring2_ulysses2": (4, 2, 2)}  # name: (world, ulysses, ring)
LOSS_RTOL = 1e-6


@functools.cache
def _run(world: int, sp: int, ring: int, lora: bool):
    return run_distributed("tests.workers.nft_steps:nft_step", world, sp, ring, lora)


@pytest.mark.parametrize(
    ("layout", "lora"), [("sp2", False), ("sp2", True), ("ring2_ulysses2", False)], ids=["sp2-full", "sp2-lora_kl", "ring2_ulysses2-full"]
)
def test_diffusion_nft_update_matches_one_process(layout, lora):
    world, sp, ring = LAYOUTS[layout]
    ref = _run(1, 1, 1, lora)[0]
    results = _run(world, sp, ring, lora)
    root = Path(__file__).resolve().parents[1]
    assert all(Path(r["package"]).is_relative_to(root) for r in results), "ranks import another checkout"
    for r in results:  # SP peers report the same, unscaled loss; it is the one-process loss
        assert r["loss"] == results[0]["loss"]
        assert abs(r["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), (r["loss"], ref["loss"])
    got = results[0]
    # on-policy at the first update: the old policy is the trained one (copied at start)
    assert got["old_was_theta"] == 0.0 and ref["old_was_theta"] == 0.0
    assert ref["metrics"]["old_deviate"] == 0.0 and got["metrics"]["old_deviate"] == 0.0
    assert (ref["metrics"]["kl_div"] > 0) == lora
    # the rollout: sampled by the old policy; an empty stochastic span stores its start alone (no step), no log-probs
    assert got["rollout"]["stored"][1] == 1 and got["rollout"]["old_lp"] == 0.0
    assert (got["rollout"]["final"] - ref["rollout"]["final"]).abs().max().item() <= 1e-4
    assert abs(got["reward_mean"] - ref["reward_mean"]) <= 1e-5
    nonzero = 0
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        assert (g is None) == (g_ref is None), name
        if g_ref is None:
            continue
        ok, err = worst_grad(g, g_ref)
        assert ok, f"{layout}: grad {name} off by {err:.3e}"
        nonzero += int(g_ref.abs().max() > 0)
    assert nonzero >= 0.8 * len(ref["grads"])
    assert ref["step_moved"] > 0.1 * PARITY_LR and got["step_moved"] > 0.1 * PARITY_LR
    for name, p_ref in ref["params"].items():
        if ref["grads"][name] is None:  # no gradient, no step: untouched on both sides
            assert torch.equal(got["params"][name], p_ref), name
            continue
        ok, err, ratio = worst_step(got["params"][name], p_ref, ref["grads"][name], PARITY_LR, PARITY_EPS)
        assert ok, f"{layout}: parameter {name} after the step off by {err:.3e} ({ratio:.2f} x its bound)"
    # the old policy after the iteration: d old + (1 - d) theta, shard by shard (d = 0.001 after step 1), in fp32:
    # within 2 ulps of the blend computed here
    assert got["decay"] == ref["decay"] == 0.001
    for name, new in got["params"].items():
        expected = 0.001 * got["before"][name] + 0.999 * new
        tol = 2 * 2.0**-23 * expected.abs() + 1e-12
        assert ((got["old_after"][name] - expected).abs() <= tol).all(), name

