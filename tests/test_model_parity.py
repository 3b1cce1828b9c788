"""Model level, every diffusers version of the matrix: a tiny model of every transformer that has a context-
parallel plan - diffusers' own (Flux, Flux.2, Qwen-Image, Wan, ChronoEdit, LTX-Video, LTX-2, Helios,
MiniMax-H3, as patched by ``install()``) and sp_diffusers' (SD3, HunyuanVideo T2V and token-replace I2V,
CogVideoX 1.5, Z-Image, HunyuanVideo-1.5, Wan-VACE) - under Ulysses SP = 2 and 4 vs one process, at an even
and an uneven length (``tests/workers/model_cases.py`` says which sequences are odd), with ``ulysses_sdpa``
and with ``native`` after ``install()``; ``return_dict=True`` in each model's even ``native`` case.

Tolerance: fp32, elementwise ``|sp - ref| <= 1e-5 + 1e-4 * |ref|`` for every output and for every
parameter gradient (the SUM over the SP group). SP changes only the order of fp32 sums (per-rank partial
gradients, LayerNorm/linear over a shorter sequence), hence the relative term.

One spawned process group per (version, degree) runs every case; each (model, length) reference is computed
once per version, by one rank, and shared by both degrees, both backends and the Ulysses x Ring test.

Versions (CI budget, ~8 minutes on 2 cores): the oldest and the newest release run every model; the middle
releases (0.37.1-0.41.0) run ``MIDDLE_MODELS``, the models whose plan, plan patch or class changes inside them
(Qwen-Image's joint mask and plan, Wan's plan, Flux.2's code, Z-Image's Omni mode, LTX-2's and Helios' plans,
MiniMax-H3's arrival). The sp_diffusers joint-stream plans (SD3, HunyuanVideo, CogVideoX) also run on 0.37.1
and 0.40.0 in the Ulysses x Ring test (ring 2 x ulysses 2).
"""

from __future__ import annotations

import functools
import tempfile

import pytest

from ._dist import run_distributed
from ._matrix import MATRIX_VERSIONS, minor, sys_path_for
from .workers.model_cases import LENGTHS, MODELS

ATOL, BACKENDS = 1e-5, ("ulysses_sdpa", "native")
# classes newer than the matrix's oldest release
SINCE = {"ltx2": (0, 37), "helios": (0, 37), "minimax_h3": (0, 40)}
# the models whose plan, plan patch or class changes within the middle releases (see the module docstring)
MIDDLE_MODELS = ("qwenimage", "wan", "flux2", "zimage", "ltx2", "helios", "minimax_h3")

pytestmark = pytest.mark.matrix

_REFS = tempfile.TemporaryDirectory(prefix="sp-parity-refs-")  # removed when the session ends


def _names(version: str) -> list[str]:
    every = version in (MATRIX_VERSIONS[0], MATRIX_VERSIONS[-1])
    return [m for m in MODELS if minor(version) >= SINCE.get(m, (0, 0)) and (every or m in MIDDLE_MODELS)]


# (version, degree, "model/length/backend"): only the cases that run, so no case is reported as skipped
CASES = [
    (v, world, f"{m}/{ln}/{b}")
    for v in MATRIX_VERSIONS
    for world in (2, 4)
    for m in _names(v)
    for ln in LENGTHS
    for b in BACKENDS
]


@functools.cache
def _ref_dir(version: str) -> str:
    return tempfile.mkdtemp(prefix=f"{version}-", dir=_REFS.name)


def _parity(
    version: str, world: int, names: list[str], lengths, backends, ring: int = 1, return_dict_backend="native"
) -> dict:
    """Every rank's results merged: each case is reported by the rank that owns its reference."""
    results: dict[str, dict] = {}
    for rank, r in enumerate(
        run_distributed(
            "tests.workers.models:model_parity",
            world,
            names,
            list(lengths),
            list(backends),
            _ref_dir(version),
            ring,
            return_dict_backend,
            sys_path=sys_path_for(version),
        )
    ):
        assert r["diffusers"] == version, f"rank {rank} imported diffusers {r['diffusers']}, not {version}"
        results.update(r["results"])
    return results


@functools.cache
def _run(version: str, world: int) -> dict:
    return _parity(version, world, _names(version), LENGTHS, BACKENDS)


@pytest.mark.parametrize(("version", "world", "case"), CASES, ids=[f"{v}-P{w}-{c}" for v, w, c in CASES])
def test_output_and_every_gradient_match_one_process(version, world, case):
    r = _run(version, world)[case]
    where = f"diffusers {version} P={world} {case}" + (" (return_dict=True)" if r.get("return_dict") else "")
    assert "error" not in r, f"{where}: {r.get('error')}"
    assert r["out_err"] <= ATOL, f"{where}: output off by {r['out_abs']:.3e} (max |out| {r['out_scale']:.2g})"
    assert r["grad_err"] <= ATOL, f"{where}: a gradient is off by {r['grad_abs']:.3e}"
    # The gradient contract: the SUM over the SP group is the full gradient, one rank's share is not.
    assert r["local_only_rel"] > 0.1, f"{where}: per-rank gradients look complete"
    assert r["n_params_with_grad"] > 0.8 * r["n_params"], f"{where}: most parameters got no gradient"


def test_return_dict_true_is_covered_once_per_model():
    version = MATRIX_VERSIONS[-1]
    flagged = {case.split("/")[0] for case, r in _run(version, 2).items() if r.get("return_dict")}
    assert flagged == set(_names(version))


PURE_RING_VERSIONS = ("0.36.0", "0.42.1")  # oldest and newest
USP_CASES = [(v, 2, 2, "ring2") for v in PURE_RING_VERSIONS]
USP_CASES += [(v, 4, 4, "ring4") for v in PURE_RING_VERSIONS]
# the combined layout: 0.36.0 (refused), 0.37.1 (the first release that allows it), 0.40.0 (diffusers' ring
# backward fixed) and the newest (CI budget: the other middle releases are left out)
COMBINED_VERSIONS = ("0.36.0", "0.37.1", "0.40.0", "0.42.1")
USP_CASES += [(v, 4, 2, "ring2_ulysses2") for v in COMBINED_VERSIONS]
# the models (and joint-stream plans) the ring was built on; their references come from the Ulysses run
USP_MODELS = ["qwenimage", "flux", "wan", "sd3", "hunyuanvideo", "hunyuanvideo_i2v", "cogvideox"]


@pytest.mark.parametrize(
    ("version", "world", "ring", "layout"), USP_CASES, ids=[f"{v}-{name}" for v, _, _, name in USP_CASES]
)
def test_ulysses_x_ring_models_match_one_process(version, world, ring, layout):
    """Ulysses x Ring (USP) with ulysses_sdpa: pure ring on 2 and 4 ranks, ring 2 x ulysses 2 on 4 ranks; the
    SP degree is no longer capped by the head count (heads need only divide the Ulysses degree).

    diffusers 0.36 refuses ulysses > 1 with ring > 1 in ContextParallelConfig itself: there every case must
    end in sp_diffusers' error naming both degrees and the fix, not in diffusers' bare refusal."""
    results = _parity(
        version, world, USP_MODELS, ("even",), ("ulysses_sdpa",), ring, return_dict_backend=None
    )
    assert len(results) == len(USP_MODELS)
    refused = version == "0.36.0" and world // ring > 1 and ring > 1
    for case, r in results.items():
        if refused:
            msg = r.get("error", "")
            assert "ulysses_degree=2 together with ring_degree=2" in msg and "fix: upgrade" in msg, msg
            continue
        assert "error" not in r, f"{version} world={world} ring={ring} {case}: {r.get('error')}"
        assert r["out_err"] <= ATOL and r["grad_err"] <= ATOL, f"{version} {case}: {r}"
