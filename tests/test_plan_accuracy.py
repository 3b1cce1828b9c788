"""The planner's prediction held to the same step run for real, at a small size (benchmarks/plan_accuracy.py has
the full grid): a narrow WanTransformer3DModel (4 blocks: the block shortcut extrapolates) through
FSDPEngine.train_step on 2 gloo ranks with Ulysses 2 and activation checkpointing."""

from __future__ import annotations

from benchmarks.plan_accuracy import predict
from tests._dist import run_distributed

TOKENS = 2046  # 33 x 62: uneven over the two ranks


def test_prediction_matches_a_real_train_step():
    pred = predict(TOKENS, 2, True, False)
    ranks = run_distributed("benchmarks.plan_accuracy:measure_rank", 2, TOKENS, True, False)
    for r in ranks:
        # torch's tracker on the real tensors counts what the planner counted on fake ones: the same step, so
        # the same bytes (1%: room for a kernel that allocates differently with other values)
        assert abs(pred["peak"] - r["tracker_peak"]) <= 0.01 * r["tracker_peak"], (pred, r)
        assert abs(pred["start"] - r["tracker_start"]) <= 0.01 * r["tracker_start"], (pred, r)
        # the process's resident memory grows by what the step allocates; allocator and interpreter overhead
        # (a few MiB) is not predicted, so 15% at this small size (the benchmark holds 10% from 4k tokens)
        growth = pred["peak"] - pred["start"]
        assert abs(growth - r["rss_growth"]) <= 0.15 * r["rss_growth"], (growth, r)
