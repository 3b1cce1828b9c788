"""DiffusionNFT (``algorithms/diffusion_nft.py``) held to its reference code in float64, one process.

Each check compares ours with an independent re-implementation, in this file, of NVlabs/DiffusionNFT's formulas
(``scripts/train_nft_sd3.py``: the loss block, ``return_decay``; ``flow_grpo/stat_tracking.py`` with
``global_std``; ``flow_grpo/diffusers_patch/solver.py``'s ``dpm2``), written per sample with plain Python / fp64
tensors. Tolerance: both sides are float64 and differ only in the order of operations, so they agree to a few
ulps of the values compared: ``rtol = 1e-12`` (about 4500 ulps, far below any formula difference: a wrong sign,
factor or clamp moves a value by more than 1e-3 here), ``atol = 1e-12`` for values near 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.diffusion_nft import DiffusionNFT, nft_loss, reward_prob
from sp_diffusers.flowgrpo.algorithms.old_policy import old_policy_decay
from sp_diffusers.flowgrpo.batch import IterationBatch
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
from sp_diffusers.flowgrpo.sampling.dpm_solver import DPMSolver2
from sp_diffusers.flowgrpo.sampling.sde import ode_step

RTOL = ATOL = 1e-12
C = 5.0


def _close(a, b) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)


def _config(**flowgrpo) -> TrainConfig:
    c = TrainConfig()
    c.flowgrpo.algorithm = "diffusion_nft"
    for k, v in flowgrpo.items():  # an algorithm's section: mix={"window_size": 2}, or "mix.window_size"=2
        if isinstance(v, dict):
            for key, value in v.items():
                setattr(getattr(c.flowgrpo, k), key, value)
        elif "." in k:
            section, key = k.split(".")
            setattr(getattr(c.flowgrpo, section), key, v)
        else:
            setattr(c.flowgrpo, k, v)
    return c


# ------------------------------------------------------------------------------------ rewards -> r


def _reference_r(rewards: list[float], prompts: list[str], clip: float = C) -> list[float]:
    """PerPromptStatTracker(global_std=True).update, then the loss block's clamp / normalise / clamp."""
    std = math.sqrt(sum((x - sum(rewards) / len(rewards)) ** 2 for x in rewards) / len(rewards)) + 1e-4
    out = []
    for x, p in zip(rewards, prompts, strict=True):
        group = [y for y, q in zip(rewards, prompts, strict=True) if q == p]
        a = (x - sum(group) / len(group)) / std
        a = max(-clip, min(clip, a))
        out.append(max(0.0, min(1.0, a / clip / 2.0 + 0.5)))
    return out


def _ours_r(rewards: list[float], prompts: list[str]) -> torch.Tensor:
    ids = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    algorithm = DiffusionNFT(_config())
    adv = algorithm.advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor([ids[p] for p in prompts]))
    return reward_prob(adv, C)


@pytest.mark.parametrize(
    ("rewards", "prompts"),
    [
        # every reward equal: std 0, A = 0 / 1e-4 = 0, r = 1/2 exactly
        ([0.3] * 6, list("aaabbb")),
        # a group of negative rewards beside a positive one (the group mean is subtracted: sign does not matter)
        ([-3.0, -2.0, -1.5, -0.2, 0.4, 0.9, 1.0, 2.0], list("aaaabbbb")),
        # clipping at C: one outlier per group of 40, about 6 batch stds out (r = 1 and r = 0 exactly)
        ([0.0] * 39 + [100.0] + [1.0] * 39 + [-100.0], ["a"] * 40 + ["b"] * 40),
        # one group constant, the other not
        ([0.5, 0.5, 0.5, 0.1, 0.9, 0.4], list("aaabbb")),
    ],
    ids=["all_equal", "negative_group", "clipped_at_C", "one_constant_group"],
)
def test_reward_prob_from_rewards_matches_the_reference(rewards, prompts):
    ours = _ours_r(rewards, prompts)
    ref = _reference_r(rewards, prompts)
    _close(ours, ref)
    assert ((ours >= 0) & (ours <= 1)).all()


def test_reward_prob_edges():
    assert _ours_r([0.3] * 6, list("aaabbb")).eq(0.5).all()  # no signal: 1/2, not a rounding residue
    clipped = _ours_r([0.0] * 39 + [100.0] + [1.0] * 39 + [-100.0], ["a"] * 40 + ["b"] * 40)
    assert clipped[39].item() == 1.0 and clipped[79].item() == 0.0
    a = torch.tensor([-7.0, -5.0, -2.5, 0.0, 2.5, 5.0, 7.0], dtype=torch.float64)
    _close(reward_prob(a, C), [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0])


# --------------------------------------------------------------------- implicit policies, weights, loss


def _data(b: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 6, 5)
    x0 = torch.randn(shape, generator=g, dtype=torch.float64)
    eps = torch.randn(shape, generator=g, dtype=torch.float64)
    t = torch.tensor([1.0, 0.8, 0.35, 0.05][:b], dtype=torch.float64)
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    v_old = (eps - x0) + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    v = v_old + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)  # off-policy: v != v_old
    v_ref = v_old + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
    r = torch.tensor([0.0, 0.3, 0.5, 1.0][:b], dtype=torch.float64)
    return x0, x_t, t, v, v_old, v_ref, r


def _reference_loss(x0, x_t, t, v, v_old, v_ref, r, beta, kl):
    """The reference's loss block, one sample at a time: (loss, L+ per sample, L- per sample, w+, w-)."""
    per, lp, ln, wp, wn = [], [], [], [], []
    for i in range(x0.shape[0]):
        pos = beta * v[i] + (1 - beta) * v_old[i]
        neg = (1.0 + beta) * v_old[i] - beta * v[i]
        x0p, x0n = x_t[i] - t[i] * pos, x_t[i] - t[i] * neg
        w_p = max(float((x0p - x0[i]).abs().mean()), 1e-5)
        w_n = max(float((x0n - x0[i]).abs().mean()), 1e-5)
        l_p = ((x0p - x0[i]) ** 2 / w_p).mean()
        l_n = ((x0n - x0[i]) ** 2 / w_n).mean()
        per.append(r[i] * l_p / beta + (1.0 - r[i]) * l_n / beta)
        lp.append(l_p), ln.append(l_n), wp.append(w_p), wn.append(w_n)
    policy = (torch.stack(per) * C).mean()
    kl_term = torch.stack([((v[i] - v_ref[i]) ** 2).mean() for i in range(x0.shape[0])]).mean()
    return policy + kl * kl_term, torch.stack(lp), torch.stack(ln), wp, wn


def _reference_grad(x0, x_t, t, v, v_old, v_ref, r, beta, kl, wp, wn):
    """d loss / d v_theta by hand: the weights are constants (stopgrad), d x0+ / dv = -t beta, d x0- / dv = +t beta."""
    b, n = x0.shape[0], x0[0].numel()
    grads = []
    for i in range(b):
        pos = beta * v[i] + (1 - beta) * v_old[i]
        neg = (1.0 + beta) * v_old[i] - beta * v[i]
        e_p, e_n = x_t[i] - t[i] * pos - x0[i], x_t[i] - t[i] * neg - x0[i]
        d_p = 2 * e_p * (-t[i] * beta) / (n * wp[i])
        d_n = 2 * e_n * (t[i] * beta) / (n * wn[i])
        grads.append(C / b * (r[i] * d_p + (1 - r[i]) * d_n) / beta + kl * 2 * (v[i] - v_ref[i]) / (b * n))
    return torch.stack(grads)


@pytest.mark.parametrize(("beta", "kl"), [(1.0, 1e-4), (0.1, 1e-4), (0.5, 0.0), (1.0, 0.3)])
def test_loss_policies_weights_and_gradient_match_the_reference(beta, kl):
    x0, x_t, t, v, v_old, v_ref, r = _data()
    v = v.clone().requires_grad_(True)
    loss, m = nft_loss(v, v_old, x0, x_t, t, r, beta=beta, clip=C, kl_coef=kl, v_ref=v_ref, normalizer=3.0)
    (grad,) = torch.autograd.grad(loss, v)
    ref, lp, ln, wp, wn = _reference_loss(x0, x_t, t, v.detach(), v_old, v_ref, r, beta, kl)
    _close(loss * 3.0, ref)  # the normalizer divides
    _close(m["loss"], ref)
    _close(m["positive_loss"], lp.mean())
    _close(m["negative_loss"], ln.mean())
    _close(m["reward_prob_mean"], r.mean())
    _close(grad * 3.0, _reference_grad(x0, x_t, t, v.detach(), v_old, v_ref, r, beta, kl, wp, wn))
    assert grad.abs().max() > 1e-3  # the case exercises the gradient


def test_implicit_policies_are_the_reference_mixes():
    """v+ and v- through the loss: with r = 1 only L+ counts, with r = 0 only L-; at beta = 1 v+ is v itself."""
    x0, x_t, t, v, v_old, _, _ = _data()
    for r_value, key in ((1.0, "positive_loss"), (0.0, "negative_loss")):
        r = torch.full((4,), r_value, dtype=torch.float64)
        _, m = nft_loss(v, v_old, x0, x_t, t, r, beta=1.0, clip=C)
        _close(m["unweighted_policy_loss"], m[key])
    # at beta = 1, v+ = v: L+ = mean((x_t - t v - x0)^2) / mean|x_t - t v - x0|
    e = x_t - t.view(-1, 1, 1) * v - x0
    expected = ((e**2).mean(dim=(1, 2)) / e.abs().mean(dim=(1, 2))).mean()
    _, m = nft_loss(v, v_old, x0, x_t, t, torch.ones(4, dtype=torch.float64), beta=1.0, clip=C)
    _close(m["positive_loss"], expected)


def test_weights_floor_and_on_policy_gradient():
    x0, x_t, t, v, _, _, r = _data()
    # x0+ = x0 exactly for sample 0 (v+ = v_old = v with x_t - t v = x0): the weight floors at 1e-5, no NaN
    v = v.clone()
    v[0] = (x_t[0] - x0[0]) / t[0]
    v_old = v.clone()
    vv = v.clone().requires_grad_(True)
    loss, _ = nft_loss(vv, v_old, x0, x_t, t, r, beta=1.0, clip=C)
    (grad,) = torch.autograd.grad(loss, vv)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # on-policy (v = v_old) x0+ = x0-: the gradient is (2r - 1) times the positive term; zero where r = 1/2
    assert grad[2].abs().max().item() == 0.0 and grad[3].abs().max() > 1e-3  # r = 0.5 and r = 1


# ------------------------------------------------------------------------------------ decay schedules


def _return_decay(step: int, decay_type: int) -> float:
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


@pytest.mark.parametrize(
    ("name", "decay_type", "edges"),
    [
        ("copy", 0, {0: 0.0, 1: 0.0, 10**6: 0.0}),
        ("linear_to_0_5", 1, {0: 0.0, 1: 0.001, 499: 0.499, 500: 0.5, 501: 0.5, 10**6: 0.5}),
        ("delayed_linear_to_0_999", 2, {0: 0.0, 74: 0.0, 75: 0.0, 76: 0.0075, 208: 0.9975, 209: 0.999, 10**6: 0.999}),
    ],
)
def test_old_policy_decay_schedules_at_their_edges(name, decay_type, edges):
    for step, value in edges.items():
        assert old_policy_decay(step, name) == _return_decay(step, decay_type), (name, step)
        assert old_policy_decay(step, name) == pytest.approx(value, abs=1e-15), (name, step)
    with pytest.raises(ValueError, match=r"flowgrpo\.nft.decay='ema'.*copy, linear_to_0_5, delayed_linear_to_0_999"):
        old_policy_decay(3, "ema")


# ------------------------------------------------------------------------------------------ the dpm2 solver


def _reference_dpm2(v_fn, z, sigmas):
    """solver.py's run_sampling(solver="dpm2", determistic=True), fp64: DDIM first and last, else 2nd order."""
    sig = sigmas.to(torch.float64)
    outputs, n = [None, None], len(sig) - 1
    for i in range(n):
        x0 = z - sig[i] * v_fn(z, float(sig[i]))
        outputs = [outputs[1], x0]
        t, s = sig[i + 1], sig[i]
        if i == 0 or i == n - 1:
            noise_pred = (z - (1 - s) * x0) / s
            z = (1 - t) * x0 + torch.sqrt(t**2) * noise_pred
        else:
            lam = lambda x: torch.log(1 - x) - torch.log(x)  # noqa: E731 - log(0) = -inf at sigma = 1, as there
            h, h0 = lam(t) - lam(s), lam(s) - lam(sig[i - 1])
            d1 = (1.0 / (h0 / h)) * (outputs[1] - outputs[0])
            z = (t / s) * z - ((1 - t) * (torch.exp(-h) - 1.0)) * outputs[1] - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
    return z


def _v_fn(z, sigma):
    return torch.tanh(z) * (1.5 - sigma) + 0.3 * z**2 * sigma  # nonlinear: the multistep term matters


@pytest.mark.parametrize("first_sigma", [1.0, 0.999999], ids=["pure_noise", "unipc_like"])
def test_dpm2_rollout_matches_the_reference_solver(first_sigma):
    sigmas = torch.tensor([first_sigma, 0.9, 0.75, 0.55, 0.3, 0.12, 0.0], dtype=torch.float64)
    z0 = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    solver, z, euler = DPMSolver2(), z0.clone(), z0.clone()
    for i in range(len(sigmas) - 1):
        z = solver.step(z, _v_fn(z, float(sigmas[i])), sigmas, i)
        euler = ode_step(euler, _v_fn(euler, float(sigmas[i])), float(sigmas[i]), float(sigmas[i + 1]))
        if i < 2 and first_sigma == 1.0:
            _close(z, euler)  # first order there (D1 = 0 where sigma_{i-1} = 1): Euler
    _close(z, _reference_dpm2(_v_fn, z0, sigmas))
    assert (z - euler).abs().max() > 1e-3  # the second-order steps are not Euler's
    with pytest.raises(ValueError, match="step 3 after step -1"):
        DPMSolver2().step(z0, z0, sigmas, 3)


# ------------------------------------------------------------------------------------------ the plan, keys


def test_plan_trains_a_random_subset_of_every_schedule_step_per_sample():
    algorithm = DiffusionNFT(_config(num_steps=10))
    batch = IterationBatch(["p"] * 6, {}, torch.arange(6), torch.zeros(6))
    algorithm.plan(batch, torch.Generator().manual_seed(0), 0, torch.Generator())
    steps = batch.plan.train_steps
    assert steps.shape == (6, 9)  # int(10 * 0.99)
    for row in steps.tolist():
        assert len(set(row)) == 9 and set(row) <= set(range(10))  # without replacement, step 0 (sigma 1) included
    assert len({tuple(r) for r in steps.tolist()}) > 1  # each sample its own
    span = algorithm.span(batch.plan, None)
    assert (span.start, span.size, span.rule) == (0, 0, None) and type(span.solver).__name__ == "DPMSolver2"
    assert algorithm.inputs().evaluation == "forward_process" and not algorithm.inputs().old_log_probs
    assert not algorithm.drops_zero_advantage()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("cfg_scale", 4.5, r"flowgrpo\.cfg_scale=4\.5.*without classifier-free guidance.*cfg_scale=1\.0"),
        ("nft.decay", "ema", r"flowgrpo\.nft.decay='ema'.*copy, linear_to_0_5"),
        ("nft.solver", "dpm3", r"flowgrpo\.nft.solver='dpm3'.*dpm2.*euler"),
        ("nft.beta", 0.0, r"flowgrpo\.nft.beta=0\.0.*> 0"),
        ("nft.timestep_fraction", 0.05, r"flowgrpo\.nft.timestep_fraction=0\.05.*at least one step"),
    ],
)
def test_bad_keys_are_refused_naming_the_key(key, value, match):
    from sp_diffusers.flowgrpo.build import check_algorithm

    check_algorithm(_config())  # the defaults pass
    with pytest.raises(ConfigError, match=match):
        check_algorithm(_config(**{key: value}))
