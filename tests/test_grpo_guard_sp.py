"""GRPO-Guard under sequence parallelism on real gloo ranks vs one process: the same update, the same parameters.

One update on a fixed trajectory whose samples each have their own SDE window (a micro-batch's rows at different
sigmas: the guard's scale is their mean), at SP 2 and at Ulysses 2 x Ring 2 (4 ranks), against one process; and
each layout's first update on a fresh rollout (full-SDE with recomputed old log-probs and means, the same with the
rollout's own, and per-sample windows): the normalised ratio exactly 1.

Tolerances (tests/_parity.py): gradients within ``1e-5 + 1e-4 |ref|`` (fp32 sums in another order; the guard's
``1 / mean(sqrt(-dt))^2`` scales a gradient and its rounding alike, so the relative bound stands, and every ratio
sits at least 2x away from the clip boundary, so no clipping decision can flip), parameters after the AdamW step
within the bound that implies (AdamW eps = lr = 1e-3), the loss within 1e-6 relative (the reweighting makes it
O(10), so the engine test's 1e-6 absolute becomes relative). On-policy, the ratio exactly 1, ppo_kl and the
mean-drift bias exactly 0: the training forward of a shuffled micro-batch repeats the rollout's arithmetic bit for
bit (docs/training.md, "The on-policy ratio").
"""

from __future__ import annotations

import functools

import pytest
import torch

from ._dist import run_distributed
from ._parity import PARITY_EPS, PARITY_LR, worst_grad, worst_step

LAYOUTS = {"sp2": (2, 2, 1), "ring2_ulysses2": (4, 2, 2)}  # name: (world, ulysses, ring)


@functools.cache
def _run(world: int, sp: int, ring: int):
    return run_distributed("tests.workers.guard_steps:guard_update", world, sp, ring)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_guard_update_matches_one_process(layout):
    world, sp, ring = LAYOUTS[layout]
    ref = _run(1, 1, 1)[0]
    results = _run(world, sp, ring)
    assert 0 < ref["clipfrac"] < 1, "the data must exercise both clipped and unclipped samples"
    assert ref["ratio_mean_bias"] > 0, "the old means must differ from the current ones (the bias term runs)"
    for r in results:  # every rank reports the same loss: the single-process one
        assert abs(r["loss"] - ref["loss"]) <= 1e-6 * max(1.0, abs(ref["loss"])), (r["loss"], ref["loss"])
    got = results[0]
    assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 0
    nonzero = 0
    for name, g_ref in ref["grads"].items():
        ok, err = worst_grad(got["grads"][name], g_ref)
        assert ok, f"{layout}: grad {name} off by {err:.3e}"
        nonzero += int(g_ref.abs().max() > 0)
    assert nonzero >= 0.8 * len(ref["grads"])
    assert ref["step_moved"] > 0.1 * PARITY_LR and got["step_moved"] > 0.1 * PARITY_LR  # the step ran
    for name, p_ref in ref["params"].items():
        if name not in ref["grads"]:
            assert torch.equal(got["params"][name], p_ref), name
            continue
        ok, err, ratio = worst_step(got["params"][name], p_ref, ref["grads"][name], PARITY_LR, PARITY_EPS)
        assert ok, f"{layout}: parameter {name} after the step off by {err:.3e} ({ratio:.2f} x its bound)"


@pytest.mark.parametrize("layout", ["one_process", *sorted(LAYOUTS)])
def test_on_policy_ratio_is_one(layout):
    world, sp, ring = LAYOUTS.get(layout, (1, 1, 1))
    for r in _run(world, sp, ring):
        for name, m in r["on_policy"].items():
            # exactly: the training forward repeats the rollout's arithmetic bit for bit (docs/training.md)
            assert m["ratio_mean"] == 1.0 and m["ratio_std"] == 0.0, (layout, name, m)
            assert m["ppo_kl"] == 0.0 and m["clipfrac"] == 0.0, (layout, name, m)
            assert m["ratio_mean_bias"] == 0.0, (layout, name, m)
            assert m["trained_samples"] > 0, (layout, name, m)
        # 6 steps: the full-SDE rollout trains int(6 * 0.99) = 5; per-sample windows train 2, at several starts
        assert r["on_policy"]["all"]["trained_steps"] == 5
        assert r["on_policy"]["per_sample_windows"]["trained_steps"] == 2
        assert r["on_policy"]["per_sample_windows"]["distinct_starts"] > 1
        assert set(r["on_policy"]) == {"all", "all_rollout_means", "per_sample_windows", "micro_batches_of_2"}
