"""DanceGRPO and flow_grpo's CPS step on Wan under SP, and the zero-advantage filter under dp x SP (gloo ranks).

On-policy (old log-probs taken from the rollout, the micro-batch = the rollout batch) the training forward
repeats the rollout's arithmetic, so the ratio is 1 and ppo_kl 0 to float32 rounding of identical operations
(1e-6; in practice exactly): a mis-sharded video sequence, a text padding the model attends to, or a per-sample
timestep applied to the wrong sample would change one of the two forwards. The update's parity with one process
(gradients and parameters) is tests/test_engine.py (``wan_pipeline``).
"""

from __future__ import annotations

import functools

from ._dist import run_distributed


@functools.cache
def _algorithms(world: int, sp: int):
    return run_distributed("tests.workers.video_steps:algorithms", world, sp)


def test_dance_grpo_and_cps_on_policy_ratio_is_one_under_dp_and_sp():
    results = _algorithms(4, 2)  # dp 2 x SP 2
    for r in results:
        dance, cps = r["dance"], r["cps"]
        assert dance["trained_steps"] == 3  # int((6 - 1) * 0.6) steps per video
        assert "DanceGRPO" in dance["schedule"] and "UniPC" in cps["schedule"]
        assert len(set(cps["text_lengths"])) > 1, "byte-level prompts must be ragged"
        for m in (dance, cps):
            assert m["ratio_mean"] == 1.0 and m["ratio_std"] == 0.0, m  # bit for bit (docs/training.md)
            assert m["ppo_kl"] == 0.0 and m["clipfrac"] == 0.0, m
            assert m["grad_norm"] > 0  # the update ran and had a gradient
    # SP peers (ranks 0, 1 form dp rank 0) rolled out the same videos
    for name in ("dance", "cps"):
        assert (results[0][name]["final"] - results[1][name]["final"]).abs().max().item() == 0.0


def test_dance_grpo_and_cps_rollouts_under_sp_match_one_process():
    """dp rank 0 draws the same prompts, noise and trained steps as the single process (seeds by dp rank)."""
    ref = _algorithms(1, 1)[0]
    got = _algorithms(4, 2)[0]
    assert got["dance"]["dp_rank"] == 0
    for name in ("dance", "cps"):
        assert (got[name]["final"] - ref[name]["final"]).abs().max().item() <= 1e-4
        assert (got[name]["log_probs"] - ref[name]["log_probs"]).abs().max().item() <= 1e-4


def test_zero_advantage_filter_keeps_dp_ranks_in_step():
    results = run_distributed("tests.workers.video_steps:zero_advantage_filter", 4, 2)
    for r in results:
        # rank 0's two non-zero samples; rank 1 tops up with two zero ones: the same count, the same steps
        assert r["first"]["trained_samples"] == 2 and r["first"]["step_skipped"] == 0.0
        assert r["first"]["zero_advantage_fraction"] == 0.75
        assert r["global_step_after_first"] == 1
        assert len(r["kept"]) == 2
        if r["dp_rank"] == 0:
            assert r["kept"] == [2, 3]
        # all rewards equal: no update anywhere, parameters untouched, metrics still finite
        assert r["second"]["trained_samples"] == 0 and r["second"]["step_skipped"] == 1.0
        assert r["global_step_after_second"] == 1 and r["moved_by_second"] == 0.0
    by_dp = {}
    for r in results:  # SP peers keep the same samples
        by_dp.setdefault(r["dp_rank"], []).append(r["kept"])
    assert all(a == b for a, b in by_dp.values())
