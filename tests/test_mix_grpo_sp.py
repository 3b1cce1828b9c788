"""MixGRPO under sequence parallelism on real gloo ranks vs one process: Ulysses SP 2 and Ulysses x Ring (ring 2 x
ulysses 2, world 4). Each layout runs tests/workers/mix_steps.py once: a rollout with the DPM-Solver++ tail, one
update from identical parameters, and the on-policy update of a fresh rollout.

Tolerances: gradients and parameters after the AdamW step as tests/test_engine.py (derived in tests/_parity.py:
fp32, only the order of sums differs; AdamW eps = lr = 1e-3 keeps the step well-conditioned); the loss within 1e-6
absolute. The rollout (4 fp32 forwards of a 2-layer model, the SDE steps and the tail) within 1e-4 of one process,
as the FlowGRPO rollout in tests/test_engine.py: the attention's reduction order changes rounding at ~1e-7 relative
per forward, and the steps' coefficients are O(1) (measured: final latents 4.8e-6, log-probs 1.2e-7). On-policy,
the micro-batch is the rollout batch, so training repeats the rollout's arithmetic: ratio 1 and ppo_kl 0 to fp32
rounding (1e-6, 1e-9; measured: exactly 1 and 0), the KL term 0.5 mean((lp - lp_old)^2) below 1e-12 (measured 0).
"""

from __future__ import annotations

import functools

import pytest
import torch

from ._dist import run_distributed
from ._parity import PARITY_EPS, PARITY_LR, worst_grad, worst_step

LAYOUTS = {"sp2": (2, 2, 1), "ring2_ulysses2": (4, 2, 2)}  # name: (world, ulysses, ring)


@functools.cache
def _run(world: int, sp: int, ring: int) -> list[dict]:
    return run_distributed("tests.workers.mix_steps:mix_grpo_step", world, sp, ring)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mix_grpo_update_matches_one_process(layout):
    ref = _run(1, 1, 1)[0]
    results = _run(*LAYOUTS[layout])
    assert abs(results[0]["loss"] - ref["loss"]) <= 1e-6 and all(r["loss"] == results[0]["loss"] for r in results)
    assert ref["kl_loss"] > 1e-7, "the KL term must take part (old log-probs off by 5e-4 or 3e-3)"
    assert 0 < ref["clipfrac"] < 1, "the data must exercise both clipped and unclipped samples"
    got = results[0]
    assert got["n_trainable"] == ref["n_trainable"] > 0
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
    assert ref["step_moved"] > 0.1 * PARITY_LR and got["step_moved"] > 0.1 * PARITY_LR  # the step ran
    for name, p_ref in ref["params"].items():
        g_ref = ref["grads"][name]
        if g_ref is None:
            assert torch.equal(got["params"][name], p_ref), name
            continue
        ok, err, ratio = worst_step(got["params"][name], p_ref, g_ref, PARITY_LR, PARITY_EPS)
        assert ok, f"{layout}: parameter {name} after the step off by {err:.3e} ({ratio:.2f} x its bound)"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mix_grpo_rollout_with_tail_matches_one_process(layout):
    ref = _run(1, 1, 1)[0]
    assert ref["window"] == (0, 2)  # iteration 0: the first window
    for r in _run(*LAYOUTS[layout]):
        assert r["window"] == ref["window"]
        assert (r["final"] - ref["final"]).abs().max().item() <= 1e-4
        assert (r["log_probs"] - ref["log_probs"]).abs().max().item() <= 1e-4
        assert abs(r["reward_mean"] - ref["reward_mean"]) <= 1e-5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mix_grpo_on_policy_ratio_is_one(layout):
    for r in _run(*LAYOUTS[layout]):
        p = r["on_policy"]
        assert p["trained_samples"] > 0, "no sample trained: the ratio below would be the skip's default"
        assert p["window"] == (0, 2, 3)  # the window's 2 steps stored (3 latents), trained
        assert p["ratio_mean"] == 1.0 and p["ratio_std"] == 0.0, (layout, p)  # bit for bit (docs/training.md)
        assert p["ppo_kl"] == 0.0 and p["clipfrac"] == 0.0, (layout, p)
        assert 0 <= p["kl_loss"] <= 1e-12
        assert r["cur_timesteps"] == 0.0
