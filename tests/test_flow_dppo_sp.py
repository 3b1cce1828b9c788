"""Flow-DPPO under sequence parallelism on real gloo ranks vs one process: the same update, the same parameters
(tests/workers/dppo_steps.py builds the data).

Tolerances (tests/_parity.py): gradients within ``1e-5 + 1e-4 |ref|`` (fp32 sums in another order; every ratio sits
2e-4 or more from 1 and every row's divergence is 1e-11 or above 0.1 against the 1e-5 threshold, so no mask decision
can flip), parameters after the AdamW step within the bound that implies, the loss within 1e-6 relative. On-policy,
the ratio is exactly 1 and nothing is masked (the update's forward repeats the rollout's arithmetic bit for bit).
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed
from ._parity import assert_update_matches

LAYOUTS = {"sp2": (2, 2, 1), "ring2_ulysses2": (4, 2, 2)}  # name: (world, ulysses, ring)


@functools.cache
def _run(world: int, sp: int, ring: int):
    return run_distributed("tests.workers.dppo_steps:dppo_update", world, sp, ring)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flow_dppo_update_matches_one_process(layout):
    world, sp, ring = LAYOUTS[layout]
    ref = _run(1, 1, 1)[0]
    results = _run(world, sp, ring)
    assert 0 < ref["masked"] < ref["outside"] <= 0.5 + 1e-9, "rows outside the region, some of them moving away"
    for r in results:
        assert abs(r["loss"] - ref["loss"]) <= 1e-6 * max(1.0, abs(ref["loss"])), (r["loss"], ref["loss"])
        assert r["masked"] == ref["masked"] and r["outside"] == ref["outside"]
    assert_update_matches(results[0], ref, layout)


@pytest.mark.parametrize("layout", ["one_process", *sorted(LAYOUTS)])
def test_flow_dppo_first_update_is_on_policy(layout):
    world, sp, ring = (1, 1, 1) if layout == "one_process" else LAYOUTS[layout]
    for r in _run(world, sp, ring):
        m = r["on_policy"]
        assert m["ratio_mean"] == 1.0 and m["ratio_std"] == 0.0 and m["ppo_kl"] == 0.0, m
        assert m["clipfrac"] == 0.0 and m["kl_new_old_max"] == 0.0, m
