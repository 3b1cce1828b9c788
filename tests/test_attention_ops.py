"""Op level: the all-to-all and ``ulysses_sdpa_attention`` vs full-sequence SDPA, on real gloo ranks.

Tolerances: the all-to-all moves values, so placement is checked exactly (0.0). Attention runs the same
SDPA kernel on the same per-head data as the reference, only the number of heads per call differs, so
fp32 results agree to rounding; the ring's math kernel and log-sum-exp merge sum in another order. Each
gradient entry sums at most S = 32 products of O(1) values, so a different fp32 order moves it by up to
about S * 2**-24 * (a partial sum of O(2)) = 4e-6: ATOL 5e-6 (the model-level bar is 1e-5 + 1e-4 |ref|).
Every case runs at even lengths and at lengths that divide no degree (``uneven:``).
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed

WORLDS = (2, 4)
ATOL = 5e-6


@functools.cache
def _run(target: str, world: int):
    return run_distributed(f"tests.workers.attention_ops:{target}", world)


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_placement_and_inverse(world):
    for rank_result in _run("all_to_all_checks", world):
        for name, err in rank_result.items():
            assert err == 0.0, f"P={world} {name}: max error {err}"


def _case_names():
    from .workers.attention_ops import _cases, _uneven

    cases = _cases(2)
    return [c["name"] for c in cases] + [_uneven(c)["name"] for c in cases]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", _case_names())
def test_attention_parity(world, case):
    for rank, rank_result in enumerate(_run("attention_parity", world)):
        errs = rank_result[case]
        for what in ("out", "dq", "dk", "dv"):
            assert errs[what] <= ATOL, (
                f"P={world} rank {rank} {case}: {what} max error {errs[what]:.3e} > {ATOL}"
            )


@pytest.mark.parametrize("world", WORLDS)
def test_dropout_is_not_ignored(world):
    for r in _run("dropout_is_applied", world):
        assert r["dropout_changes_output"] > 1e-3
        assert r["no_dropout_repeatable"] == 0.0


EXPECTED_WORDS = {
    "return_lse": ["return_lse", "Fix"],
    "dtype_mismatch": ["dtype", "float32", "float64"],
    "mask_wrong_shape": ["attn_mask", "local", "global"],
    "mask_local_both_dims": ["local length", "key-padding"],
    "mask_5d": ["attn_mask", "5 dims"],
    "gqa_kv_heads_not_divisible": ["H_kv=3", "ulysses_degree", "fix"],
    "mask_and_causal": ["is_causal", "attn_mask"],
    "three_dim_query": ["4-D", "query"],
}


@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_raise_clear_errors(world):
    for messages in _run("bad_inputs", world):
        assert set(messages) == set(EXPECTED_WORDS)
        for name, words in EXPECTED_WORDS.items():
            msg = messages[name]
            assert msg is not None, f"{name}: no error raised"
            for w in words:
                assert w in msg, f"{name}: {w!r} missing from error: {msg}"


USP_LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (ulysses, ring) on 4 ranks; dp = 4 / (ulysses * ring)


@pytest.mark.parametrize(("ulysses", "ring"), USP_LAYOUTS, ids=[f"u{u}_r{r}" for u, r in USP_LAYOUTS])
def test_ulysses_x_ring_parity(ulysses, ring):
    """Ulysses x Ring: K/V stream around the ring, partial results merge by log-sum-exp (sp_diffusers.parallel.ring).

    fp32 cases: same bar as above (ATOL; the merge adds one rescale per chunk, O(1e-7)). Every case also
    runs with the plain-math chunk kernel ("math:"), the path for non-CPU devices. bf16: the result is
    compared with fp32 SDPA, so the bar is bf16 resolution of O(1) values (2**-8 relative -> 3e-2 abs for
    outputs, 1e-1 for gradients that sum S terms). Cases whose K/V heads do not divide U are skipped.
    Every case also runs at lengths that divide no degree (``uneven:``): ring segments of different lengths.
    """
    results = run_distributed("tests.workers.attention_ops:usp_parity", 4, ulysses, ring)
    # every case at even and uneven lengths, less the three heads_not_divisible ones of each when U > 1
    n_cases = len(_case_names()) - (6 if ulysses > 1 else 0)
    for rank, rank_result in enumerate(results):
        if ring > 1:
            drop = rank_result.pop("dropout")
            assert drop["changes_output"] > 0.1, f"rank {rank}: dropout_p=0.5 did not change the output"
            assert drop["finite"] == 1.0
            assert drop["no_dropout_matches_reference"] <= ATOL
            bf16 = rank_result.pop("bf16")
            assert bf16["out"] <= 3e-2, f"rank {rank}: bf16 out off by {bf16['out']:.3e}"
            for what in ("dq", "dk", "dv"):
                assert bf16[what] <= 1e-1, f"rank {rank}: bf16 {what} off by {bf16[what]:.3e}"
            assert sum(not c.startswith("math:") for c in rank_result) == n_cases
            assert sum(c.startswith("math:") for c in rank_result) == n_cases
        else:
            assert len(rank_result) == n_cases
        for case, errs in rank_result.items():
            for what in ("out", "dq", "dk", "dv"):
                assert errs[what] <= ATOL, (
                    f"U={ulysses} R={ring} rank {rank} {case}: {what} off by {errs[what]:.3e}"
                )


MISMATCH_WORDS = {
    "mask_on_one_rank": ["disagree", "attn_mask", "none", "rank 0", "fix"],
    "global_vs_local_mask": ["different form", "global", "local", "fix"],
    "causal_on_one_rank": ["disagree", "is_causal", "fix"],
    "batch_differs": ["disagree", "batch", "same micro-batch"],
    "heads_differ": ["disagree", "heads"],
    "head_dim_differs": ["disagree", "head dim"],
    "dtype_differs": ["disagree", "dtype", "torch.float64", "torch.float32"],
    "scale_differs": ["disagree", "scale", "0.5"],
    "local_error_on_one_rank": ["refused the call", "rank 0", "4-D"],
}


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_disagree_fail_together_and_promptly(world):
    """Inputs that differ across the SP group (the red team's hangs and silent mixes): one error, the same on
    every rank, within seconds (the process-group timeout is 120 s here), naming the input and the ranks."""
    results = _run("rank_mismatches", world)
    for name, words in MISMATCH_WORDS.items():
        messages = {r[name]["message"] for r in results}
        assert len(messages) == 1 and None not in messages, f"P={world} {name}: {messages}"
        (msg,) = messages
        for w in words:
            assert w in msg, f"P={world} {name}: {w!r} missing from: {msg}"
        assert all(r[name]["type"] == "UlyssesAttentionError" for r in results)
        assert max(r[name]["seconds"] for r in results) < 10, name


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_without_tokens_and_an_empty_batch_work(world):
    """One token over P ranks (ranks 1.. hold none) and batch 0 give one process's numbers."""
    for r in _run("rank_mismatches", world):
        for name in ("one_token", "empty_batch"):
            assert "error" not in r[name], f"P={world} {name}: {r[name]}"
            assert r[name]["out"] <= ATOL and r[name]["dq"] <= ATOL, (name, r[name])
