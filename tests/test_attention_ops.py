"""Op level: the all-to-all and ``ulysses_sdpa_attention`` vs full-sequence SDPA, on real gloo ranks.

Tolerances: the all-to-all moves values, so placement is checked exactly (0.0). Attention runs the same
SDPA kernel on the same per-head data as the reference, only the number of heads per call differs, so
fp32 results agree to rounding: atol 2e-6 (values are O(1); the model-level bar is 1e-5).
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed

WORLDS = (2, 4)
ATOL = 2e-6


@functools.cache
def _run(target: str, world: int):
    return run_distributed(f"tests.workers.attention_ops:{target}", world)


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_placement_and_inverse(world):
    for rank_result in _run("all_to_all_checks", world):
        for name, err in rank_result.items():
            assert err == 0.0, f"P={world} {name}: max error {err}"


def _case_names():
    from .workers.attention_ops import _cases

    return [c["name"] for c in _cases(2)]


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
    """Ulysses x Ring: K/V stream around the ring, partial results merge by log-sum-exp (sp_diffusers.ring).

    fp32 cases: same bar as above (ATOL; the merge adds one rescale per chunk, O(1e-7)). Every case also
    runs with the plain-math chunk kernel ("math:"), the path for non-CPU devices. bf16: the result is
    compared with fp32 SDPA, so the bar is bf16 resolution of O(1) values (2**-8 relative -> 3e-2 abs for
    outputs, 1e-1 for gradients that sum S terms). Cases whose K/V heads do not divide U are skipped.
    """
    results = run_distributed("tests.workers.attention_ops:usp_parity", 4, ulysses, ring)
    n_cases = len(_case_names())
    for rank, rank_result in enumerate(results):
        if ring > 1:
            assert sum(not c.startswith("math:") for c in rank_result) >= n_cases - 4
            assert sum(c.startswith("math:") for c in rank_result) >= n_cases - 4
            drop = rank_result.pop("dropout")
            assert drop["changes_output"] > 0.1, f"rank {rank}: dropout_p=0.5 did not change the output"
            assert drop["finite"] == 1.0
            assert drop["no_dropout_matches_reference"] <= ATOL
            bf16 = rank_result.pop("bf16")
            assert bf16["out"] <= 3e-2, f"rank {rank}: bf16 out off by {bf16['out']:.3e}"
            for what in ("dq", "dk", "dv"):
                assert bf16[what] <= 1e-1, f"rank {rank}: bf16 {what} off by {bf16[what]:.3e}"
        else:
            assert len(rank_result) >= n_cases - 4
        for case, errs in rank_result.items():
            for what in ("out", "dq", "dk", "dv"):
                assert errs[what] <= ATOL, (
                    f"U={ulysses} R={ring} rank {rank} {case}: {what} off by {errs[what]:.3e}"
                )
