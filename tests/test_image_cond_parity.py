"""The image-conditioned families under SP vs one process: output and every parameter gradient, fp32.

Qwen-Image-Edit (one condition image), Qwen-Image-Edit-2511 with Plus's two images (``zero_cond_t``: per-token
modulation index split with the tokens), FLUX.1 Kontext (condition tokens with ids ``(1, r, c)``), Wan I2V (condition
as channels, CLIP tokens before a 512-row text) and Wan2.2 TI2V (per-token timesteps, 0 on the first frame) - each
through the model's own context-parallel plan (diffusers'; ``install()``'s patches), the condition tokens sharded with
the noisy ones. Ulysses SP = 2 and 3 at an even and an uneven length (``tests/workers/model_cases.COND_MODELS``: at
SP = 3 every length is uneven; the uneven case makes the joint sequence odd, so a shard boundary falls inside the
condition image), and Ulysses 2 x Ring 2 on 4 ranks (4 heads: the Ulysses degree divides them).

Tolerance as in ``test_model_parity.py``: elementwise ``|sp - ref| <= 1e-5 + 1e-4 |ref|`` for every output and every
parameter gradient (the SUM over the SP group): only the order of fp32 sums changes. Installed diffusers only (the
transformer classes and plans are the text-to-image ones the matrix already covers; these cases add the condition's
inputs).
"""

from __future__ import annotations

import functools
import tempfile

import pytest

from ._dist import run_distributed
from .workers.model_cases import COND_MODELS, LENGTHS

ATOL = 1e-5
_REFS = tempfile.TemporaryDirectory(prefix="sp-cond-parity-refs-")
NAMES = list(COND_MODELS)
LAYOUTS = {"P2": (2, 1), "P3": (3, 1), "U2xR2": (4, 2)}  # name -> (world, ring)


@functools.cache
def _run(layout: str) -> dict:
    world, ring = LAYOUTS[layout]
    results: dict[str, dict] = {}
    for r in run_distributed(
        "tests.workers.models:model_parity",
        world,
        NAMES,
        list(LENGTHS),
        ["ulysses_sdpa"],
        _REFS.name,
        ring,
        None,
        timeout=900,
    ):
        results.update(r["results"])
    return results


CASES = [(layout, f"{m}/{ln}/ulysses_sdpa") for layout in LAYOUTS for m in NAMES for ln in LENGTHS]


@pytest.mark.parametrize(("layout", "case"), CASES, ids=[f"{a}-{c}" for a, c in CASES])
def test_conditioned_output_and_every_gradient_match_one_process(layout, case):
    r = _run(layout)[case]
    where = f"{layout} {case}"
    assert "error" not in r, f"{where}: {r.get('error')}"
    assert r["out_err"] <= ATOL, f"{where}: output off by {r['out_abs']:.3e} (max |out| {r['out_scale']:.2g})"
    assert r["grad_err"] <= ATOL, f"{where}: a gradient is off by {r['grad_abs']:.3e}"
    assert r["local_only_rel"] > 0.1, f"{where}: per-rank gradients look complete"
    assert r["n_params_with_grad"] > 0.8 * r["n_params"], f"{where}: most parameters got no gradient"
