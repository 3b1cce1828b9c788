"""Flow-DPPO's loss equals its reference in float64: verl-omni ``verl_omni/trainer/diffusion/diffusion_algos.py``,
``FlowDPPOLoss.compute_loss`` (fetched 2026-12-06, commit a1139baf), whose lines ``_reference`` below restates (the
exact divergence of one SDE step, the asymmetric mask, the mean over every row with masked rows as zeros).

Cases: the schedule's first step (sigma 1, large ``s``) and its last (small ``s``: the divergence grows as
``1 / s^2``), all-equal advantages (zero: every loss 0), a threshold so large that nothing is masked (the plain
``-A rho``), one so small that every row moving away is, and ``add_kl_coefficient: false``. The gradient is compared
too: the mask carries none. Tolerance 1e-12 (float64; the same operations in another order).
"""

from __future__ import annotations

import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.flow_dppo import flow_dppo_loss
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule

TOL = 1e-12


def _reference(lp, old, adv, mean, old_mean, std, sqrt_dt, threshold, add_kl_coefficient=True):
    """FlowDPPOLoss.compute_loss's arithmetic (no rollout importance weights); its std_dev_t is [B, 1, ...]."""
    std = std.reshape(std.shape[0], *[1] * (mean.ndim - 1))
    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    diff = (mean - old_mean).pow(2)
    if add_kl_coefficient:
        sigma = std * sqrt_dt.reshape(sqrt_dt.shape[0], *[1] * (std.ndim - 1))
        per_elem = diff / (2 * sigma.pow(2))
    else:
        per_elem = diff / 2
    per_sample = per_elem.mean(dim=tuple(range(1, per_elem.ndim)))
    high = per_sample >= threshold
    remove = (high & (ratio > 1.0) & (adv > 0)) | (high & (ratio < 1.0) & (adv < 0))
    return torch.mean(torch.where(~remove, unclipped, torch.zeros(()))), remove.double().mean()


def _case(step: int, seed: int, b: int = 6):
    g = torch.Generator().manual_seed(seed)
    sigmas = linspace_schedule(10, 3.0).sigmas.double()
    sqrt_dt = torch.full((b,), float(torch.sqrt(sigmas[step] - sigmas[step + 1])), dtype=torch.float64)
    std = torch.full((b,), 0.7 * float(torch.sqrt(sigmas[step] / (1 - min(sigmas[step], sigmas[1])))), dtype=torch.float64)
    old_mean = torch.randn(b, 4, 3, generator=g, dtype=torch.float64)
    # drifts of several sizes: some rows inside the region, some past it
    mean = old_mean + torch.logspace(-4, -1, b, dtype=torch.float64).view(b, 1, 1) * torch.randn(
        b, 4, 3, generator=g, dtype=torch.float64
    )
    old = torch.randn(b, generator=g, dtype=torch.float64)
    lp = old + 0.05 * torch.randn(b, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return lp, old, adv, mean, old_mean, std, sqrt_dt


@pytest.mark.parametrize("step", [0, 8], ids=["first_step", "last_trained_step"])
@pytest.mark.parametrize(
    "threshold, add_kl, zero_adv",
    [(1e-5, True, False), (1e30, True, False), (1e-300, True, False), (1e-5, False, False), (1e-5, True, True)],
    ids=["default", "nothing_masked", "every_mover_masked", "no_kl_coefficient", "all_equal_rewards"],
)
def test_flow_dppo_equals_verl_omni(step, threshold, add_kl, zero_adv):
    for seed in range(3):
        lp, old, adv, mean, old_mean, std, sqrt_dt = _case(step, seed)
        if zero_adv:
            adv = torch.zeros_like(adv)
        lp_a, mean_a = lp.clone().requires_grad_(), mean.clone().requires_grad_()
        lp_b, mean_b = lp.clone().requires_grad_(), mean.clone().requires_grad_()
        ours, metrics = flow_dppo_loss(
            lp_a, old, adv, mean_a, old_mean, std, sqrt_dt, threshold=threshold, kl_coefficient=add_kl
        )
        theirs, masked = _reference(lp_b, old, adv, mean_b, old_mean, std, sqrt_dt, threshold, add_kl)
        assert abs(float(ours) - float(theirs)) <= TOL
        assert float(metrics["clipfrac"]) == float(masked)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(lp_a.grad, lp_b.grad, atol=TOL, rtol=0)
        assert mean_a.grad is None or float(mean_a.grad.abs().max()) == 0.0  # no gradient through the mask
        if threshold == 1e30:  # nothing masked: the plain policy gradient
            assert float(masked) == 0.0 and abs(float(ours) + float((adv * torch.exp(lp - old)).mean())) <= TOL
        if threshold == 1e-300 and not zero_adv:
            assert 0 < float(masked) < 1  # the rows moving away, not the others
        if zero_adv:
            assert float(ours) == 0.0


def test_the_divergence_grows_towards_the_end_of_the_schedule():
    """The same drift is a larger divergence where the step's noise is small, by the ratio of the variances."""
    early, late = _case(0, 0), _case(8, 0)  # one seed: the same drift at both steps
    first = flow_dppo_loss(*early, threshold=1e-5)[1]["kl_new_old_mean"]
    last = flow_dppo_loss(*late, threshold=1e-5)[1]["kl_new_old_mean"]
    s_early, s_late = float(early[5][0] * early[6][0]), float(late[5][0] * late[6][0])
    assert s_late < s_early and abs(float(last) / float(first) - (s_early / s_late) ** 2) <= 1e-9
