"""Model level, every diffusers version of the matrix: tiny Flux, Wan, Qwen-Image (batch 2, ragged
text mask) and, with sp_diffusers' plans, HunyuanVideo (T2V, and token-replace I2V whose first latent frame
ends inside a shard; ragged text mask padded to the degree) and CogVideoX 1.5 (RoPE input; odd text length
padded to the degree + key mask, against the unpadded model with diffusers' own processor) under Ulysses
SP = 2 and 4 vs one process, with ``ulysses_sdpa`` and with ``native`` after ``install()``, ``return_dict``
True and False.

Tolerance: fp32, elementwise ``|sp - ref| <= 1e-5 + 1e-4 * |ref|`` for the output and for every
parameter gradient (the all-reduced SUM over the SP group). SP changes only the order of fp32 sums
(per-rank partial gradients, LayerNorm/linear over a shorter sequence), hence the relative term.
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed
from ._matrix import MATRIX_VERSIONS, sys_path_for

ATOL, KINDS, BACKENDS, RETURN_DICTS = (
    1e-5,
    ("qwenimage", "flux", "wan", "sd3", "hunyuanvideo", "hunyuanvideo_i2v", "cogvideox"),
    ("ulysses_sdpa", "native"),
    (False, True),
)
CASES = [f"{k}/{b}/return_dict={rd}" for k in KINDS for b in BACKENDS for rd in RETURN_DICTS]

pytestmark = pytest.mark.matrix


@functools.cache
def _run(version: str, world: int) -> list[dict]:
    return run_distributed(
        "tests.workers.models:model_parity",
        world,
        list(KINDS),
        list(BACKENDS),
        list(RETURN_DICTS),
        sys_path=sys_path_for(version),
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("version", MATRIX_VERSIONS)
def test_output_and_every_gradient_match_one_process(version, world, case):
    for rank, result in enumerate(_run(version, world)):
        assert result["diffusers"] == version
        r = result["results"][case]
        assert "error" not in r, f"diffusers {version} P={world} rank {rank} {case}: {r.get('error')}"
        assert r["out_err"] <= ATOL, f"{version} P={world} {case}: output off by {r['out_abs']:.3e}"
        assert r["grad_err"] <= ATOL, f"{version} P={world} {case}: a gradient is off by {r['grad_abs']:.3e}"
        # The gradient contract: the SUM over the SP group is the full gradient, one rank's share is not.
        assert r["local_only_rel"] > 0.1, f"{version} P={world} {case}: per-rank gradients look complete"
        assert r["n_params_with_grad"] > 0.8 * r["n_params"]


PURE_RING_VERSIONS = ("0.36.0", "0.42.1")  # oldest and newest; the combined layout runs on every version
USP_CASES = [(v, 2, 2, "ring2") for v in PURE_RING_VERSIONS]
USP_CASES += [(v, 4, 4, "ring4") for v in PURE_RING_VERSIONS]
USP_CASES += [(v, 4, 2, "ring2_ulysses2") for v in MATRIX_VERSIONS]


@pytest.mark.parametrize(
    ("version", "world", "ring", "layout"), USP_CASES, ids=[f"{v}-{name}" for v, _, _, name in USP_CASES]
)
def test_ulysses_x_ring_models_match_one_process(version, world, ring, layout):
    """Ulysses x Ring (USP) with ulysses_sdpa: pure ring on 2 and 4 ranks, ring 2 x ulysses 2 on 4 ranks; the
    SP degree is no longer capped by the head count (heads need only divide the Ulysses degree).

    diffusers 0.36 refuses ulysses > 1 with ring > 1 in ContextParallelConfig itself: there every case must
    end in sp_diffusers' error naming both degrees and the fix, not in diffusers' bare refusal."""
    results = run_distributed(
        "tests.workers.models:model_parity",
        world,
        list(KINDS),
        ["ulysses_sdpa"],
        [False],
        ring,
        sys_path=sys_path_for(version),
    )
    refused = version == "0.36.0" and world // ring > 1 and ring > 1
    for rank, result in enumerate(results):
        for case, r in result["results"].items():
            if refused:
                msg = r.get("error", "")
                assert "ulysses_degree=2 together with ring_degree=2" in msg and "fix: upgrade" in msg, msg
                continue
            assert "error" not in r, (
                f"{version} world={world} ring={ring} rank {rank} {case}: {r.get('error')}"
            )
            assert r["out_err"] <= ATOL and r["grad_err"] <= ATOL, f"{version} {case}: {r}"
