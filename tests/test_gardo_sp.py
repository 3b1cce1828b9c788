"""GARDO under sequence parallelism on real gloo ranks vs one process: the same update, the same parameters
(tests/workers/gardo_steps.py builds the data).

Tolerances (tests/_parity.py): gradients within ``1e-5 + 1e-4 |ref|`` (fp32 sums in another order; every ratio sits
2e-4 or more from 1 against the clip range 1e-3, so no clipping decision can flip; the gate is fixed), parameters
after the AdamW step within the bound that implies, the loss and the KL within 1e-5 relative (the KL is a mean of
squared fp32 differences of step means, each rounded differently per layout). On-policy, the ratio is exactly 1 (the
update's forward repeats the rollout's arithmetic bit for bit) and the KL to the just-copied reference is exactly 0.
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed
from ._parity import assert_update_matches

LAYOUTS = {"sp2": (2, 2, 1), "ring2_ulysses2": (4, 2, 2)}  # name: (world, ulysses, ring)


@functools.cache
def _run(world: int, sp: int, ring: int):
    return run_distributed("tests.workers.gardo_steps:gardo_update", world, sp, ring)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gardo_update_matches_one_process(layout):
    world, sp, ring = LAYOUTS[layout]
    ref = _run(1, 1, 1)[0]
    results = _run(world, sp, ring)
    assert ref["first_kl"] == 0.0, "nothing gated in the first update: no KL"
    assert ref["kl"] > 0 and ref["gated"] == 0.5 and 0 < ref["clipfrac"] < 1, ref
    for r in results:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])), (r["loss"], ref["loss"])
        assert abs(r["kl"] - ref["kl"]) <= 1e-5 * ref["kl"], (r["kl"], ref["kl"])
        assert r["clipfrac"] == ref["clipfrac"] and r["gated"] == ref["gated"]
    assert_update_matches(results[0], ref, layout)


@pytest.mark.parametrize("layout", ["one_process", *sorted(LAYOUTS)])
def test_gardo_first_update_is_on_policy(layout):
    world, sp, ring = (1, 1, 1) if layout == "one_process" else LAYOUTS[layout]
    for r in _run(world, sp, ring):
        m = r["on_policy"]
        assert m["ratio_mean"] == 1.0 and m["ratio_std"] == 0.0 and m["ppo_kl"] == 0.0, m
        assert m["clipfrac"] == 0.0 and m["kl"] == 0.0, m
        assert m["trained_samples"] == 8.0
        # the gate's metric is this batch's gate (dp 1); at most a fifth of 8 rows: the top 10% of those with u >= 0
        assert m["kl_gated_samples"] == float(m["gate"].double().mean()) <= 0.2, m
        assert m["advantages"].abs().sum() > 0
