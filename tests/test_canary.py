"""The GPU-path canary in CI: every family with a plan, forward and backward at world size 8, on torch's fake
process group and the ``meta`` device (``tests/workers/canary.py`` says how and why), in a subprocess so that
the fake group does not leak into other tests.

Asserted per case: it ran (a host read of a tensor or a CPU-born tensor meeting the model's would have raised),
backward reached the parameters, and the aten attention ops that ran inside sp_diffusers' attention are fused
kernels only - flash or efficient, forward and backward, never a score matrix (no ``bmm``/``softmax``, no
SDPA math). Three injected regressions show that the canary catches each kind.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from .workers.model_cases import MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_KERNELS = {
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
}
CASES = [f"{m}/{layout}" for layout in ("u8r1/bfloat16", "u4r2/float32") for m in MODELS]


@functools.cache
def _canary() -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "tests.workers.canary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_every_family_runs_forward_and_backward_at_world_8(case):
    r = _canary()[case]
    assert "error" not in r, f"{case}: {r.get('error')} at {r.get('where')}"
    assert r["attention_calls"] >= 1 and r["outputs"], case
    assert r["params_with_grad"] >= 0.8 * r["params"], (
        f"{case}: backward reached {r['params_with_grad']}/{r['params']}"
    )
    if r["device"] == "meta":
        ops = set(r["ops"])
        assert ops <= CUDA_KERNELS, f"{case}: non-fused attention ops {sorted(ops - CUDA_KERNELS)}"
        assert any(op.endswith("attention.default") for op in ops), f"{case}: no fused forward kernel ran"
        assert any(op.endswith("backward.default") for op in ops), f"{case}: no fused backward kernel ran"
    else:  # HunyuanVideo-1.5: CPU tensors (see the worker); sp_diffusers' own code still reads no tensor
        assert r["syncs_ours"] == [], f"{case}: host reads in sp_diffusers: {r['syncs_ours']}"


def test_bf16_without_a_mask_runs_flash_and_masked_calls_run_the_efficient_kernel():
    runs = _canary()
    assert "aten._scaled_dot_product_flash_attention.default" in runs["flux/u8r1/bfloat16"]["ops"]
    # SD3's padded text is a key mask: those calls take the efficient kernel's bias
    assert "aten._scaled_dot_product_efficient_attention.default" in runs["sd3/u8r1/bfloat16"]["ops"]


def test_the_canary_catches_each_kind_of_regression():
    runs = _canary()
    assert "item() cannot be called on meta" in runs["negative:host_read"]["error"]
    assert "not on the expected device meta" in runs["negative:cpu_born"]["error"]
    assert not set(runs["negative:math_kernel"]["ops"]) <= CUDA_KERNELS


def test_ring_attention_memory_at_16k_tokens_is_linear_in_the_sequence():
    """Ring attention (R = 8, one rank's share: 2,048 queries, 8 K/V chunks of 2,048) forward and backward at
    S = 16k on the CPU flash kernel, under torch's memory tracker: the peak stays within 32 copies of this
    rank's queries (inputs, two K/V buffers, fp32 accumulators, gradients - none of them grows with the chunk
    length) and no allocation comes near one chunk's score matrix ``[B, H, 2048, 2048]``. The control runs the
    plain math kernel (at S = 4k), whose score matrix the same measurement must see."""
    fused, math = _canary()["ring_memory"]["fused"], _canary()["ring_memory"]["math"]
    assert fused["peak"] <= 32 * fused["q_bytes"], fused
    assert fused["largest"] < fused["score_bytes"] / 16, fused
    assert math["largest"] >= math["score_bytes"], math


def test_the_gradient_contract_on_ncclish_reduce_ops():
    """FSDPEngine at world 8 on the fake group (not gloo, so the NCCL path): FSDP2's reduce-scatter over all 8
    ranks carries the divide factor itself - ``PREMUL_SUM(1/dp)`` with dp = 2, sp = 4 (each rank's gradient
    times 1/2, summed over 8 ranks: the SUM over the SP group, the MEAN over dp), ``AVG`` with dp = 8, sp = 1 -
    in fp32 under bf16 mixed precision, and nothing is divided before or after (a pre- or post-division would
    count the factor twice). HSDP with 2 replica groups of 4 at dp = 2, sp = 4: ``PREMUL_SUM(1/2)`` within a group
    of 4, then one all-reduce ``SUM`` across the 2 groups per reduce-scatter (the 8 ranks' sum, halved once)."""
    runs = _canary()["gradient_contract"]
    # layout: (reduce-scatter op, its factor, its group size, all-reduce group size or None)
    expected = {
        "dp2_sp4": ("PREMUL_SUM", 0.5, 8, None),
        "dp8_sp1": ("AVG", None, 8, None),
        "dp2_sp4_replicate2": ("PREMUL_SUM", 0.5, 4, 2),
    }
    assert set(runs) == set(expected)
    for layout, (op, factor, group, replicas) in expected.items():
        calls, all_reduces = runs[layout]["calls"], runs[layout]["all_reduces"]
        assert calls, f"{layout}: no reduce-scatter ran"
        seen = {(c["op"], c["factor"], c["dtype"], c["group"]) for c in calls}
        assert seen == {(op, factor, "float32", group)}, (layout, calls)
        assert len(all_reduces) == (len(calls) if replicas else 0), (layout, all_reduces)
        seen = {(c["op"], c["factor"], c["dtype"], c["group"]) for c in all_reduces}
        assert seen <= {("SUM", None, "float32", replicas)}, (layout, all_reduces)
        assert runs[layout]["divisions"] == [], (layout, runs[layout]["divisions"])
