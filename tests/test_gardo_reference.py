"""GARDO equals its reference in float64: flow_grpo (fetched 2026-12-06, commit 94e23ee5405ab7241fc1f75d30cac8147e2b1f53),
whose arithmetic the ``_reference_*`` helpers below restate:

- ``_reference_advantages``: ``flow_grpo/stat_tracking.py`` ``PerPromptStatTracker.update(prompts, rewards, dists,
  type='gardo')`` on a cleared tracker (the training loop clears it every epoch), with the caller's
  ``np.nan_to_num`` of the features; rewards ``[N, T]`` (the main reward repeated over the trained steps).
- ``_reference_ranks`` / ``_reference_uncertainty`` / ``_reference_gate``: ``scripts/train_sd3_gardo.py`` ``main``,
  the block after ``stat_tracker.update``: ranks 1..N of a descending ``torch.sort``, ``rank_main - (rank_aesthetic
  + rank_imagereward) / 2``, ``dynamic_controller.update`` of the values >= 0, then ``np.percentile`` of them at
  ``100 - beta * 100`` and the gate ``u > threshold``.
- ``_ReferenceRiskCompensator``: the same file's ``RiskCompensator`` (constructed with its defaults: base 0.1,
  range [0.02, 0.2], rate 0.1, window 20).
- ``_reference_loss``: the same file's training loop: advantages clamped to ``+-adv_clip_max``, the clipped ratio
  weighted by ``std_dev_t / mean(std_dev_t)`` (the commented-out plain mean where ``std_weighting`` is off), the KL
  ``mean((mu - mu_ref)^2 / (2 std_dev_t^2))`` over the gated rows, ``mean(policy) + beta * mean(kl)``, the policy
  term alone where no row is gated or beta is 0.

Cases: the advantages over unequal, interleaved groups, with a tight and a loose clip (ours clamps in
``gardo_advantages``, the reference in its loss: the test clamps the reference's output), NaN features, all-equal
rewards (ours exactly 0, the reference 0 up to rounding); the ranks and the uncertainty on untied rewards (the
reference's unstable sort orders ties arbitrarily; ours ranks ties in index order, tested alone); the KL fraction over
36 iterations that go up, down, clip at both ends and outlive the window; the percentile gate at the fraction's values;
the loss, its metrics and its gradient (``log_prob`` and ``prev_sample_mean``) at the schedule's first step (large
std) and a late one (small std), the rows' std differing, with and without gated rows, ``kl_coef`` 0 and large,
``clip_range`` tiny (every ratio clipped) and huge (none), ``std_weighting`` off. Where the reference fails, ours is
asserted alone, saying why: a group of one sample (the reference takes ``np.min`` of an empty array and raises) and a
group whose features are all equal (the reference divides 0 by 0: NaN) keep weight 1.

Tolerance 1e-12 (float64; the same operations, some in another order); ranks, gates and fractions exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.gardo import (
    KLFraction,
    _ranks,
    diversity_weights,
    gardo_advantages,
    gardo_loss,
    gated_rows,
    uncertainty,
)
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule

TOL = 1e-12


# ------------------------------------------------------------------------------------------ reference restatements
def _reference_advantages(groups, rewards, features, steps: int = 3) -> np.ndarray:
    """PerPromptStatTracker.update(type='gardo'): per prompt, ``(r - mean) * w`` with ``w`` 1 below the mean, else the
    nearest other sample's cosine distance over the group's mean of it. Returns ``[N, steps]``."""
    prompts = np.array([f"prompt {int(g)}" for g in groups])
    r = np.repeat(np.asarray(rewards, dtype=np.float64)[:, None], steps, axis=1)
    f = np.nan_to_num(np.asarray(features, dtype=np.float64))
    f = f / np.linalg.norm(f, ord=2, axis=1, keepdims=True)
    out = np.zeros_like(r)
    for p in np.unique(prompts):
        rows = prompts == p
        centered = r[rows] - np.mean(r[rows], axis=0, keepdims=True)
        distance = 1 - np.clip(f[rows] @ f[rows].T, -1, 1)
        nearest = np.array([np.min(np.delete(distance[i], i)) for i in range(len(distance))])
        d = np.repeat(nearest[:, None], steps, axis=1)
        out[rows] = centered * np.where(centered < 0, np.ones_like(d), d / np.mean(d))
    return out


def _reference_ranks(scores) -> torch.Tensor:
    """Ranks 1..N of a descending torch.sort (float32, as the reference keeps them)."""
    x = torch.tensor(np.asarray(scores))
    order = torch.sort(x, descending=True).indices
    ranks = torch.empty_like(x).long()
    ranks[order] = torch.arange(1, len(x) + 1)
    return ranks.float()


def _reference_uncertainty(main, aesthetic, imagereward) -> torch.Tensor:
    return _reference_ranks(main) - (_reference_ranks(aesthetic) + _reference_ranks(imagereward)) / 2


def _reference_gate(u: torch.Tensor, beta: float) -> tuple[np.ndarray, float]:
    """The gate ``u > percentile(u >= 0, 100 - 100 beta)`` and the threshold."""
    nonneg = np.array([p for p in u.numpy() if p >= 0])
    threshold = np.percentile(nonneg, 100 - beta * 100)
    return u.numpy() > threshold, float(threshold)


class _ReferenceRiskCompensator:
    """RiskCompensator(): the fraction moves by 10% when the mean of this iteration's scores leaves the range of the
    last 20 means, clipped to [0.02, 0.2]; the first iteration sets it to the base."""

    def __init__(self) -> None:
        self.buffer: list[float] = []
        self.base, self.alpha, self.beta, self.low, self.high = 0.1, 0.1, 0.1, 0.02, 0.2

    def update(self, scores: np.ndarray) -> None:
        level = np.mean(scores)
        if not self.buffer:
            self.beta = self.base
        elif level > max(self.buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif level < min(self.buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.low, self.high)
        self.buffer = [*self.buffer, level][-20:]


def _reference_loss(lp, old, adv, std, mean, ref_mean, gate, *, clip_range, adv_clip, beta, std_weighting=True):
    """The training loop's loss of one step; ``std`` ``[B, 1, 1, 1]`` as sde_step_with_logprob returns it.
    Returns ``(loss, clipfrac, mean kl)``."""
    adv = torch.clamp(adv, -adv_clip, adv_clip)
    ratio = torch.exp(lp - old)
    rows = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    if std_weighting:
        rows = std[:, 0, 0, 0] / torch.mean(std[:, 0, 0, 0]) * rows
    kl = torch.zeros_like(rows)
    loss = torch.mean(rows)
    if beta > 0 and True in gate:
        kl = torch.mean(torch.square(mean[gate] - ref_mean[gate]) / (2 * std[gate] ** 2))
        loss = torch.mean(rows) + beta * torch.mean(kl)
    clipfrac = torch.mean((torch.abs(ratio - 1.0) > clip_range).double())
    return loss, clipfrac, torch.mean(kl).detach()


# ------------------------------------------------------------------------------------------------- advantages
def _advantage_case(seed: int, sizes=(5, 3, 4), dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    groups = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    groups = groups[torch.randperm(len(groups), generator=g)]  # interleaved, as prompts arrive
    rewards = torch.randn(len(groups), generator=g, dtype=torch.float64)
    features = torch.randn(len(groups), dim, generator=g, dtype=torch.float64)
    return groups, rewards, features


@pytest.mark.parametrize(
    "clip, mode",
    [(5.0, "default"), (0.05, "default"), (5.0, "nan_features"), (5.0, "constant_group"), (5.0, "all_equal")],
    ids=["default", "tight_clip", "nan_features", "constant_group", "all_equal_rewards"],
)
def test_advantages_equal_stat_tracker(clip, mode):
    for seed in range(3):
        groups, rewards, features = _advantage_case(seed)
        if mode == "nan_features":
            features[0, 1] = float("nan")
            features[3, 0] = float("nan")
        if mode == "constant_group":
            rewards[groups == 1] = 0.3
        if mode == "all_equal":
            rewards = torch.full_like(rewards, 0.7)
        ours = gardo_advantages(rewards, groups, features, clip)
        theirs = _reference_advantages(groups, rewards, features)
        assert (theirs == theirs[:, :1]).all()  # one advantage per sample, repeated over the steps
        theirs = torch.from_numpy(np.clip(theirs[:, 0], -clip, clip))  # the reference clamps in its loss
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
        if clip == 0.05:
            assert bool((ours.abs() == clip).any())  # the clamp is exercised
        if mode == "constant_group":
            assert bool((ours[groups == 1] == 0).all()) and bool((ours[groups != 1] != 0).all())
        if mode == "all_equal":
            assert bool((ours == 0).all())  # exactly; the reference's are 0 up to rounding
            assert float(theirs.abs().max()) <= TOL


def test_below_mean_rows_keep_weight_one():
    groups, rewards, features = _advantage_case(4)
    centered = rewards - torch.stack([rewards[groups == g].mean() for g in groups])
    weights = diversity_weights(features, groups, centered)
    below = centered < 0
    assert bool(below.any()) and bool((~below).any())
    assert bool((weights[below] == 1).all())
    assert bool((weights[~below] != 1).all())  # above the mean: the novelty weight
    ours = gardo_advantages(rewards, groups, features, 1e9)
    torch.testing.assert_close(ours[below], centered[below], atol=TOL, rtol=0)
    theirs = torch.from_numpy(_reference_advantages(groups, rewards, features)[:, 0])
    torch.testing.assert_close(ours[~below] / centered[~below], theirs[~below] / centered[~below], atol=1e-9, rtol=0)


def test_single_sample_group_keeps_weight_one():
    """The reference takes np.min of the other samples' distances, none for a group of one: it raises. Ours gives the
    sample advantage 0 (its group's mean is itself) and weight 1, and the other groups are the reference's."""
    groups, rewards, features = _advantage_case(1, sizes=(4, 1, 3))
    with pytest.raises(ValueError):
        _reference_advantages(groups, rewards, features)
    alone = groups == 1
    ours = gardo_advantages(rewards, groups, features, 5.0)
    assert float(ours[alone]) == 0.0
    assert float(diversity_weights(features, groups, torch.zeros_like(rewards))[alone]) == 1.0
    rest = ~alone
    theirs = _reference_advantages(groups[rest], rewards[rest], features[rest])[:, 0]
    torch.testing.assert_close(ours[rest], torch.from_numpy(theirs), atol=TOL, rtol=0)


def test_identical_features_keep_weight_one():
    """A group whose features are all equal has every nearest distance 0: the reference divides 0 by 0 (NaN for its
    rows at or above the mean). Ours keeps weight 1 (the plain centered reward): no sample is more novel than
    another, and a NaN advantage would poison the update. The other groups are the reference's."""
    groups, rewards, features = _advantage_case(2)
    same = groups == 0
    features[same] = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # exact unit dots
    with np.errstate(divide="ignore", invalid="ignore"):
        theirs = torch.from_numpy(_reference_advantages(groups, rewards, features)[:, 0])
    centered = rewards[same] - rewards[same].mean()
    assert bool(theirs[same][centered >= 0].isnan().all()) and bool(theirs[same][centered < 0].isfinite().all())
    ours = gardo_advantages(rewards, groups, features, 5.0)
    assert bool(ours.isfinite().all())
    torch.testing.assert_close(ours[same], centered, atol=TOL, rtol=0)
    torch.testing.assert_close(ours[~same], theirs[~same], atol=TOL, rtol=0)


def test_no_features_is_the_centered_reward():
    """features=none (ours only; the reference's gardo tracker has no such mode): the group-centered reward."""
    groups, rewards, _ = _advantage_case(3)
    ours = gardo_advantages(rewards, groups, None, 5.0)
    centered = rewards - torch.stack([rewards[groups == g].mean() for g in groups])
    torch.testing.assert_close(ours, centered.clamp(-5.0, 5.0), atol=TOL, rtol=0)


# --------------------------------------------------------------------------------------- ranks and the KL gate
@pytest.mark.parametrize("n", [7, 24, 64], ids=["n7", "n24", "n64"])
def test_uncertainty_equals_reference(n):
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        main, aesthetic, imagereward = torch.randn(3, n, generator=g, dtype=torch.float64)  # no ties
        ours = uncertainty(main, [aesthetic, imagereward])
        theirs = _reference_uncertainty(main, aesthetic, imagereward)
        assert torch.equal(_ranks(main), _reference_ranks(main).double())
        assert torch.equal(ours, theirs.double())
        assert float(ours.sum()) == 0.0  # ranks sum to the same total under every reward
        assert bool((ours > 0).any())


def test_ties_rank_in_index_order():
    main = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 1.0], dtype=torch.float64)
    assert _ranks(main).tolist() == [5.0, 1.0, 2.0, 4.0, 3.0, 6.0]
    flat = torch.zeros(6, dtype=torch.float64)  # every aux reward tied: ranks 1..6 in index order
    assert uncertainty(main, [flat, flat]).tolist() == [4.0, -1.0, -1.0, 0.0, -2.0, 0.0]


def _levels() -> list[float]:
    """Mean uncertainties of 36 iterations: rising to the top clip, falling to the bottom clip (22 steps of 10%),
    then a level above every level still in the window of 20 but below the older peak, and one inside the range."""
    up = [10.0 + k for k in range(11)]  # 10 (the base) .. 20: +10% x 8 reaches 0.2, then clipped
    down = [9.0 - 0.25 * k for k in range(23)]  # every one below the window's minimum
    return [*up, *down, 10.0, 6.0]


def test_kl_fraction_equals_risk_compensator():
    ours, theirs = KLFraction(0.1, 0.02, 0.2, 0.1, 20), _ReferenceRiskCompensator()
    spread = np.array([-0.5, 0.5, -0.25, 0.25, 0.0, 0.0, 0.0, 0.0])  # means exactly the level, in both
    fractions = []
    for level in _levels():
        scores = level + spread
        assert float(np.mean(scores)) == level
        got = ours.update(torch.from_numpy(scores))
        theirs.update(scores)
        assert got == float(theirs.beta) == ours.fraction
        assert ours.history == [float(x) for x in theirs.buffer]
        fractions.append(got)
    assert len(ours.history) == 20
    steps = np.diff(fractions)
    assert fractions[0] == 0.1
    assert bool((steps[:7] > 0).all()) and fractions[8] == 0.2 == fractions[10]  # up, then the top clip
    assert fractions[11] < 0.2 and 0.02 < fractions[31] < fractions[11] and fractions[32] == 0.02 == fractions[-3]
    # 10 is below the all-time peak of 20, which left the window: the fraction rises off the bottom clip
    assert fractions[-2] > 0.02 and fractions[-1] == fractions[-2]


@pytest.mark.parametrize("n", [8, 24, 101], ids=["n8", "n24", "n101"])
def test_gated_rows_equal_percentile_gate(n):
    fractions = [0.02, 0.1, 0.11, 0.121, 0.1331, 0.09, 0.081, 0.2]
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        main, aesthetic, imagereward = torch.randn(3, n, generator=g, dtype=torch.float64)
        u = uncertainty(main, [aesthetic, imagereward])
        for fraction in fractions:
            theirs, threshold = _reference_gate(u, fraction)
            ours = gated_rows(u, fraction)
            level = float(torch.quantile(u[u >= 0], 1.0 - fraction))
            assert abs(level - threshold) <= TOL
            assert ours.tolist() == theirs.tolist(), (seed, fraction, u.tolist())
            assert int(ours.sum()) <= fraction * int((u >= 0).sum()) + 1  # about the fraction of the u >= 0


def test_the_gate_over_iterations_equals_reference():
    """The whole chain of ``GARDO.kl_rows``: uncertainty, the fraction moved first, then the gate, for 30 iterations
    whose auxiliary rewards drift away from the main one (the uncertainty grows) and then back."""
    ours, theirs = KLFraction(0.1, 0.02, 0.2, 0.1, 20), _ReferenceRiskCompensator()
    g = torch.Generator().manual_seed(0)
    seen = set()
    for it in range(30):
        main = torch.randn(32, generator=g, dtype=torch.float64)
        drift = min(it, 30 - it) / 10  # how far the auxiliary rewards wander from the main one
        aux = [main + drift * torch.randn(32, generator=g, dtype=torch.float64) for _ in range(2)]
        u = uncertainty(main, aux)
        fraction = ours.update(u[u >= 0])
        ref_u = _reference_uncertainty(main, *aux)
        theirs.update(np.array([p for p in ref_u.numpy() if p >= 0]))
        assert fraction == float(theirs.beta)
        assert gated_rows(u, fraction).tolist() == _reference_gate(ref_u, float(theirs.beta))[0].tolist()
        seen.add(round(fraction, 12))
    assert len(seen) > 3  # the fraction moved


# ---------------------------------------------------------------------------------------------------- the loss
def _loss_case(step: int, seed: int, b: int = 6):
    """A micro-batch whose rows sit at steps ``step`` and ``step + 1`` alternately (flow_grpo's SDE std:
    ``0.7 sqrt(sigma / (1 - sigma'))``, ``sigma'`` the first step's sigma where sigma is 1)."""
    g = torch.Generator().manual_seed(seed)
    sigmas = linspace_schedule(10, 3.0).sigmas.double()
    s = sigmas[torch.tensor([step + i % 2 for i in range(b)])]
    std = 0.7 * torch.sqrt(s / (1 - torch.where(s == 1, sigmas[1], s)))
    ref_mean = torch.randn(b, 4, 3, 2, generator=g, dtype=torch.float64)
    mean = ref_mean + 0.1 * torch.randn(b, 4, 3, 2, generator=g, dtype=torch.float64)
    old = torch.randn(b, generator=g, dtype=torch.float64)
    lp = old + 0.05 * torch.randn(b, generator=g, dtype=torch.float64)
    adv = 2.0 * torch.randn(b, generator=g, dtype=torch.float64)
    gate = torch.tensor([True, False, False, True, False, True])
    return lp, old, adv, std, mean, ref_mean, gate


@pytest.mark.parametrize("step", [0, 8], ids=["first_step", "late_step"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated_rows", "none_gated"])
@pytest.mark.parametrize(
    "clip_range, kl_coef, std_weighting",
    [
        (0.02, 0.04, True),
        (0.02, 0.0, True),
        (0.02, 1e4, True),
        (1e-9, 0.04, True),
        (1e9, 0.04, True),
        (0.02, 0.04, False),
    ],
    ids=["default", "no_kl", "large_kl", "tiny_clip", "huge_clip", "no_std_weighting"],
)
def test_loss_equals_reference(step, gated, clip_range, kl_coef, std_weighting):
    adv_clip = 1.5
    for seed in range(3):
        lp, old, adv, std, mean, ref_mean, gate = _loss_case(step, seed)
        assert float(std.max() - std.min()) > 0  # per-sample stds
        if not gated:
            gate = torch.zeros_like(gate)
        lp_a, mean_a = lp.clone().requires_grad_(), mean.clone().requires_grad_()
        lp_b, mean_b = lp.clone().requires_grad_(), mean.clone().requires_grad_()
        ours, metrics = gardo_loss(
            lp_a,
            old,
            adv.clamp(-adv_clip, adv_clip),  # ours clamps in gardo_advantages, the reference here
            std,
            clip_range=clip_range,
            std_weighting=std_weighting,
            kl_coef=kl_coef,
            gate=gate,
            prev_sample_mean=mean_a,
            ref_prev_sample_mean=ref_mean,
            normalizer=1.0,
        )
        theirs, clipfrac, kl = _reference_loss(
            lp_b,
            old,
            adv,
            std.view(-1, 1, 1, 1),
            mean_b,
            ref_mean,
            gate,
            clip_range=clip_range,
            adv_clip=adv_clip,
            beta=kl_coef,
            std_weighting=std_weighting,
        )
        assert abs(float(ours.detach()) - float(theirs.detach())) <= TOL * max(1.0, abs(float(theirs.detach())))
        assert float(metrics["clipfrac"]) == float(clipfrac)
        assert abs(float(metrics["kl"]) - float(kl)) <= TOL * max(1.0, abs(float(kl)))
        assert float(metrics["kl_gated_fraction"]) == float(gate.double().mean())
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(lp_a.grad, lp_b.grad, atol=TOL, rtol=0)
        if gated and kl_coef > 0:
            torch.testing.assert_close(mean_a.grad, mean_b.grad, atol=TOL, rtol=TOL)
            assert bool((mean_a.grad[~gate] == 0).all()) and bool((mean_a.grad[gate] != 0).all())
        else:  # the policy term alone: no gradient reaches the means
            assert mean_b.grad is None
            assert mean_a.grad is None or float(mean_a.grad.abs().max()) == 0.0
        if kl_coef == 0 or not gated:
            assert abs(float(ours.detach()) - float(metrics["policy_loss"])) <= TOL
        if kl_coef == 1e4 and gated:
            assert float(kl_coef * metrics["kl"]) > abs(float(metrics["policy_loss"]))  # the KL term dominates
        if clip_range == 1e-9:
            assert float(clipfrac) == 1.0
        if clip_range == 1e9:  # nothing clipped: the plain weighted -A r
            a, r = adv.clamp(-adv_clip, adv_clip), torch.exp(lp - old)
            plain = (std / std.mean() * -a * r).mean()
            assert float(clipfrac) == 0.0 and abs(float(metrics["policy_loss"]) - float(plain)) <= TOL


def test_std_weighting_differs_from_plain_mean():
    """The per-sample std weight changes the loss (it is not the plain mean) at both ends of the schedule, and more
    where the stds of the rows differ more (the first step: sigma 1 against the next)."""
    gaps = []
    for step in (0, 8):
        lp, old, adv, std, *_ = _loss_case(step, 0)
        weighted, _ = gardo_loss(lp, old, adv, std, clip_range=0.02)
        plain, _ = gardo_loss(lp, old, adv, std, clip_range=0.02, std_weighting=False)
        gaps.append(abs(float(weighted) - float(plain)))
    assert all(gap > 1e-6 for gap in gaps)


def test_normalizer_divides():
    lp, old, adv, std, mean, ref_mean, gate = _loss_case(0, 1)
    kw = {"clip_range": 0.02, "kl_coef": 0.04, "gate": gate, "prev_sample_mean": mean, "ref_prev_sample_mean": ref_mean}
    one, _ = gardo_loss(lp, old, adv, std, **kw)
    eight, _ = gardo_loss(lp, old, adv, std, normalizer=8.0, **kw)
    assert abs(float(one) / 8 - float(eight)) <= TOL
