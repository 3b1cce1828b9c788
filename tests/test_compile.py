"""torch.compile through the Ulysses backend (``tests/workers/compile_checks.py`` says how each case runs).

One 4-rank process group compiles the tiny model of each family the trainer trains with
``compile_model(model, "blocks")`` - fullgraph, so a graph break anywhere in a block fails the case - under
Ulysses 4 and Ulysses 2 x Ring 2, even and uneven lengths, every family's masks (Qwen-Image's text key mask,
SD3's joint mask through ``joint_attention_kwargs``, Wan's unmasked cross-attention). Asserted per case:

- output and every parameter gradient equal eager SP within the parity tolerance (``tests/_parity.py``:
  1e-5 + 1e-4 |ref|; the graphs run AOT autograd's ATen ops eagerly, so only the order of fp32 sums moves);
- no host sync in any forward or backward graph; under Ulysses alone exactly two all-to-alls per sharded
  attention call (one SDPA kernel each; Wan's cross-attention runs locally) forward and backward, and no SDPA
  recomputed in backward;
- one compilation per block class; the first forward of each input signature runs eagerly (it learns its calls'
  layouts), the later ones use the graphs.
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed

FAMILIES = ["qwenimage", "flux", "sd3", "wan"]
RUNS = [(name, "even", 4, 1) for name in FAMILIES] + [(name, "uneven", 2, 2) for name in FAMILIES]
RUNS += [("qwenimage", "uneven", 4, 1), ("wan", "even", 2, 2)]
CASES = [f"{name}/{length}/u{u}r{r}" for name, length, u, r in RUNS]
# attention calls per block that run locally, with no exchange: Wan's cross-attention (the text is not sharded)
LOCAL_ATTENTION = {"wan": 1}
BLOCK_CLASSES = {
    "qwenimage": 1,
    "flux": 2,
    "sd3": 2,
    "wan": 1,
}  # tiny sd3: a dual-attention block and a plain one


@functools.cache
def _results() -> dict:
    return run_distributed("tests.workers.compile_checks:compile_checks", 4, RUNS, timeout=1200)[0]


@pytest.mark.parametrize("case", CASES)
def test_compiled_blocks_equal_eager_with_no_break_and_no_host_sync(case):
    r = _results()[case]
    assert "error" not in r, f"{case}: {r.get('error')}"
    assert r["out"] <= 1.0 and r["grad"] <= 1.0, f"{case}: worst/tolerance out {r['out']}, grad {r['grad']}"
    assert r["missing_nonzero"] == [], f"{case}: parameters with a gradient in eager and none compiled"
    name = case.split("/")[0]
    assert r["compiled"] == BLOCK_CLASSES[name], f"{case}: {r['compiled']} compilations"
    for kind in ("forward", "backward"):
        assert len(r["graphs"][kind]) == BLOCK_CLASSES[name], (case, kind, r["graphs"][kind])
        for g in r["graphs"][kind]:
            assert g["sync"] == 0, (case, kind, g)
            assert g["collective"] > 0, (case, kind, g)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("u4r1")])
def test_two_all_to_alls_per_attention_call_compiled(case):
    r = _results()[case]
    assert "error" not in r, f"{case}: {r.get('error')}"
    local = LOCAL_ATTENTION.get(case.split("/")[0], 0)
    for g in r["graphs"]["forward"]:
        assert g["all_to_all"] == g["collective"] == 2 * (g["sdpa"] - local) > 0, (case, g)
    for g in r["graphs"]["backward"]:
        assert g["sdpa"] == 0, f"{case}: the backward graph recomputes attention: {g}"
        assert g["all_to_all"] == g["collective"] == 2 * (g["sdpa_backward"] - local) > 0, (case, g)


def test_a_compiled_run_compiles_twice_and_keeps_the_on_policy_ratio(tmp_path):
    """20 iterations of the tiny job with train.compile=blocks, ragged prompts, an uneven image and CFG: the
    prompt set is encoded before the first iteration and padded to one length bucket, so the blocks compile once
    for rollouts (no grad) and once for training, and never again; every update is exactly on-policy."""
    iterations = 20
    history = run_distributed(
        "tests.workers.compile_checks:compiled_training", 2, str(tmp_path / "run"), iterations, timeout=900
    )[0]["history"]
    assert [m["iteration"] for m in history] == list(range(1, iterations + 1))
    assert {m["compile_graphs"] for m in history} == {2.0}, [m["compile_graphs"] for m in history]
    assert all(m["ratio_mean"] == 1.0 and m["ppo_kl"] == 0.0 for m in history), history
    assert all(m["text_encode_seconds"] == 0.0 for m in history)  # every prompt encoded before iteration 1


REGIONAL = [("qwenimage", "even", 2, 1), ("flux", "even", 2, 1), ("qwenimage", "uneven", 2, 1)]


def test_diffusers_regional_compile_runs_fullgraph_through_the_backend():
    """``model.compile_repeated_blocks(fullgraph=True)`` after ``enable_parallelism``, as a diffusers user compiles
    (no sp-diffusers wrapper): output and gradients equal eager SP within the parity tolerance, no host sync in a
    graph, the exchange inside them. An uneven sequence needs one forward of its shapes before compiling (the
    error says so otherwise); tests/workers/compile_checks.py runs it that way."""
    results = run_distributed("tests.workers.compile_checks:regional_compile", 2, REGIONAL, timeout=900)[0]
    for case, r in results.items():
        assert "error" not in r, f"{case}: {r.get('error')}"
        assert r["out"] <= 1.0 and r["grad"] <= 1.0, (case, r["out"], r["grad"])
        for kind in ("forward", "backward"):
            assert r["graphs"][kind], (case, kind)
            for g in r["graphs"][kind]:
                assert g["sync"] == 0 and g["collective"] > 0, (case, kind, g)
