"""The hot-path contract, counted for every family with a plan (``tests/workers/hot_path.py`` says how).

One 4-rank process group runs every tiny model of ``model_cases`` at its even and its uneven length under
Ulysses 4 and Ulysses 2 x Ring 2, forward+backward passes ``learn``, ``steady`` (activation checkpointing) and,
under Ulysses 4, ``trusted``. Asserted:

- every attention call, forward or recomputed in backward: at most 2 collectives (the Q/K/V exchange and the
  output exchange; the ring's point-to-point batches are counted apart), and - once a forward with these
  input shapes has run - no metadata exchange and no host sync of sp_diffusers';
- the first forward with new shapes exchanges a call's layout at most once, and only if a split of that
  forward does not divide the degree (then the sizes of a call depend on which streams make it up);
- each forward outside its calls: exactly one agreement (one collective, one host sync), none when trusted;
- backward: no metadata exchange, no host sync of sp_diffusers', at most 2 collectives per attention call.

Host syncs of diffusers' own model code (HunyuanVideo-1.5 reads tensors in its forward) are counted apart and
not asserted: they are not on this library's path.
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed
from .workers.model_cases import MODELS

LAYOUTS = [(4, 1), (2, 2)]
CASES = [f"{m}/{ln}/u{u}r{r}" for u, r in LAYOUTS for m in MODELS for ln in ("even", "uneven")]


@functools.cache
def _results() -> dict:
    return run_distributed("tests.workers.hot_path:hot_path_counts", 4, list(MODELS), LAYOUTS, timeout=1200)[
        0
    ]


def _calls(result: dict, pass_name: str) -> list[dict]:
    return result[pass_name]["calls"]["forward"] + result[pass_name]["calls"]["backward"]


@pytest.mark.parametrize("case", CASES)
def test_attention_calls_forward_and_backward_keep_the_contract(case):
    r = _results()[case]
    assert "error" not in r, f"{case}: {r.get('error')}"
    assert r["finite"], f"{case}: non-finite output"
    uneven_forward = not all(r["learn"]["even"])
    for pass_name in [p for p in ("learn", "steady", "trusted") if p in r]:
        calls = _calls(r, pass_name)
        assert r[pass_name]["calls"]["forward"], (
            f"{case} {pass_name}: no attention call went through the backend"
        )
        for i, c in enumerate(calls):
            where = f"{case} {pass_name} call {i}: {c}"
            assert c["collective"] <= 2, where
            if pass_name == "learn":
                assert c["meta"] <= int(uneven_forward) and c["sync_ours"] <= c["meta"], where
            else:
                assert c["meta"] == 0 and c["sync_ours"] == 0, where
    if r["checkpointing"]:  # every block recomputed in backward, each call replayed without asking
        assert len(r["steady"]["calls"]["backward"]) == len(r["steady"]["calls"]["forward"]), case


@pytest.mark.parametrize("case", CASES)
def test_one_agreement_per_forward_and_none_in_backward(case):
    r = _results()[case]
    assert "error" not in r, f"{case}: {r.get('error')}"
    for pass_name, agreements in [(p, n) for p, n in (("steady", 1), ("trusted", 0)) if p in r]:
        forward, backward = r[pass_name]["outside"]["forward"], r[pass_name]["outside"]["backward"]
        assert forward["meta"] == agreements and forward["sync_ours"] == agreements, (
            case,
            pass_name,
            forward,
        )
        assert backward["meta"] == 0 and backward["sync_ours"] == 0, (case, pass_name, backward)
        n_calls = len(r[pass_name]["calls"]["forward"])
        assert backward["collective"] <= 2 * n_calls, (case, pass_name, backward, n_calls)
    if case.endswith("u4r1"):
        assert r["trusted"]["sync_ops_ours"] == [], (case, r["trusted"]["sync_ops_ours"])


DISAGREEMENTS = {
    "text_differs": (
        "SPCallMismatch",
        ["different inputs", "encoder_hidden_states", "rank 0", "rank 1", "fix"],
    ),
    "dtype_differs": ("SPCallMismatch", ["different inputs", "the model", "float64", "fix"]),
    "mask_on_one_rank": (
        "SPCallMismatch",
        ["joint_attention_kwargs.encoder_hidden_states_mask", "(absent)", "fix"],
    ),
    "model_differs": ("SPCallMismatch", ["the model", "94 parameters", "62 parameters"]),
    "local_error_everywhere": ("UlyssesAttentionError", ["attn_mask has 5 dims"]),
    "rank_dependent_sequence": ("UlyssesAttentionError", ["neither split by the plan", "per_call"]),
}


@functools.cache
def _agreement() -> list[dict]:
    return run_distributed("tests.workers.forward_agreement:forward_agreement", 2, timeout=600)


@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_plan_driven_forwards_that_disagree_fail_together_and_promptly(case):
    """The once-per-forward agreement keeps the per-call handshake's guarantees: inputs or models that differ
    across the SP group, a local error on every rank, a sequence the scope cannot size (``debug_checks``):
    the same error on every rank within seconds (the process-group timeout here is 120 s), naming the input."""
    kind, words = DISAGREEMENTS[case]
    results = [r[case] for r in _agreement()]
    messages = {r["message"] for r in results}
    assert len(messages) == 1 and None not in messages, (case, messages)
    assert {r["type"] for r in results} == {kind}, (case, results)
    for word in words:
        assert word in next(iter(messages)), (case, word, messages)
    assert max(r["seconds"] for r in results) < 10, (case, results)


def test_agreement_modes_give_the_same_forward():
    """``per_forward`` (default), ``trusted`` (the engine's) and ``per_call`` (debug_checks) at an uneven length:
    the same output, bit for bit (only who asks whom changes, not a number)."""
    for r in _agreement():
        values = r["modes_agree"]["value"]
        assert values["per_forward"] == values["trusted"] == values["per_call"], values
