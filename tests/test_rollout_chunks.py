"""A rollout in chunks (``rollout.chunks``) samples what the rollout in one piece samples.

The velocity stand-in is a per-sample function (``test_grpo_guard_reference._Engine``: no reduction across the
batch), so a chunk's numbers do not depend on the other chunks' samples; what could differ is the SDE noise, which
``BatchNoise`` draws for the whole batch and hands each chunk its rows. The comparison's tolerance, 1e-5 absolute in
float32 (bit-equal on this host), covers an elementwise kernel rounding a shorter batch's tail lanes differently on
another vector width: an ulp (2.4e-7 at these magnitudes, below 4) per step over 8 steps; another noise draw differs
by O(1).
"""

from __future__ import annotations

import pytest
import torch

from sp_diffusers.flowgrpo.sampling.denoise import Sampler, Span, denoise, denoise_in_chunks
from sp_diffusers.flowgrpo.sampling.dpm import compressed_tail
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule
from sp_diffusers.flowgrpo.sampling.sde import StepRule
from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

from .test_grpo_guard_reference import _Adapter, _cond, _Engine

ATOL = 1e-5  # float32, the same noise: only a shorter batch's rounding on another CPU (module docstring)


def _cond_with_negative(b: int) -> dict:
    cond = _cond(b)
    neg = _cond(b, seed=1)
    return {**cond, **{f"negative_{k}": v for k, v in neg.items()}}


def _fields(t: Trajectory) -> dict[str, torch.Tensor]:
    names = ("latents", "log_probs", "final", "train_steps", "starts", "means")
    return {n: getattr(t, n) for n in names if getattr(t, n) is not None}


CASES = {
    "one window": dict(span=Span(2, 3, StepRule("sde", 0.7))),
    "per-sample windows": dict(span=Span([0, 3, 1, 5, 2, 0, 4], 2, StepRule("sde", 0.7))),
    "cps, step means kept": dict(span=Span(1, 2, StepRule("cps", 0.8)), keep_means=True),
    "dance, final prediction": dict(span=Span(0, 4, StepRule("dance", 0.3)), final_is_prediction=True),
    "MixGRPO's tail": dict(span=Span(1, 2, StepRule("sde", 0.7), tail=compressed_tail(8, 3.0, 2, 0.5))),
    "CFG in one forward": dict(span=Span(2, 2, StepRule("sde", 0.7)), cfg=3.0),
    "CFG in two": dict(span=Span(2, 2, StepRule("sde", 0.7)), cfg=3.0, cfg_batch=False),
}


@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("case", list(CASES))
def test_chunks_sample_what_one_piece_samples(case, chunks):
    spec = CASES[case]
    b, cfg = 7, spec.get("cfg", 1.0)
    sampler = Sampler(_Engine(), _Adapter(), linspace_schedule(8, 3.0), cfg, spec.get("cfg_batch", True))
    cond = _cond_with_negative(b) if cfg > 1 else _cond(b)
    noise = torch.randn(b, 6, 4, generator=torch.Generator().manual_seed(3))
    extra = {k: spec[k] for k in ("keep_means", "final_is_prediction") if k in spec}
    whole = denoise(sampler, cond, noise, spec["span"], torch.Generator().manual_seed(11), **extra)
    seen = []
    pieces = denoise_in_chunks(
        sampler,
        lambda rows: {k: v[rows] for k, v in cond.items()},
        noise,
        spec["span"],
        torch.Generator().manual_seed(11),
        chunks,
        on_chunk=lambda rows, traj: seen.append((rows.start, rows.stop, traj.final.shape[0])),
        **extra,
    )
    sizes = [len(t) for t in torch.arange(b).tensor_split(chunks)]
    assert [n for *_, n in seen] == sizes and seen[0][0] == 0 and seen[-1][1] == b  # each chunk handed over in order
    assert pieces.window_start == whole.window_start
    got, want = _fields(pieces), _fields(whole)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=name)


def test_another_seed_is_another_rollout():
    """The tolerance above can fail: the chunks' noise is the batch's, not merely some noise."""
    sampler = Sampler(_Engine(), _Adapter(), linspace_schedule(8, 3.0))
    cond, noise, span = _cond(4), torch.randn(4, 6, 4), Span(2, 3, StepRule("sde", 0.7))
    whole = denoise(sampler, cond, noise, span, torch.Generator().manual_seed(11))
    # each chunk drawing its own noise (its own generator): what BatchNoise prevents
    own = [
        denoise(sampler, {k: v[r] for k, v in cond.items()}, noise[r], span, torch.Generator().manual_seed(11))
        for r in (slice(0, 2), slice(2, 4))
    ]
    assert (Trajectory.cat(own).final - whole.final).abs().max() > 100 * ATOL
