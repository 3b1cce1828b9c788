"""FlowGRPO math (schedule, SDE step, advantages, loss) against hand computations; single process, CPU.

Tolerances: reference computations run in float64 with the same formulas evaluated independently (python
floats or ``torch.distributions.Normal``), on O(1..10) values, so the two agree to float64 rounding
(~1e-15 relative); 1e-10 leaves room for the different evaluation order and still catches any formula
error, which would show up at >= 1e-3. Float32 results (the schedule) are compared at 1e-6 (a few ulps).
"""

from __future__ import annotations

import math

import pytest
import torch

from sp_diffusers.flowgrpo import (
    SDEStep,
    flow_sigmas,
    flowgrpo_loss,
    group_advantages,
    ode_step,
    qwenimage_mu,
    sde_step_with_logprob,
    timesteps_from_sigmas,
)

F64 = 1e-10


def _close(actual, expected, tol=F64):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


# --------------------------------------------------------------------------------------------- schedule


def test_flow_sigmas_plain():
    s = flow_sigmas(4)
    assert s.dtype == torch.float32 and s.shape == (5,)
    # linspace(1, 1/4, 4) = [1, 0.75, 0.5, 0.25], then the terminal 0.
    _close(s, [1.0, 0.75, 0.5, 0.25, 0.0], 0.0)
    _close(timesteps_from_sigmas(s), [1000.0, 750.0, 500.0, 250.0], 0.0)


@pytest.mark.parametrize("kwargs", [{}, {"shift": 3.0}, {"mu": 0.8}, {"mu": -0.3}])
@pytest.mark.parametrize("n", [2, 10, 37])
def test_flow_sigmas_shape_endpoints_monotonic(n, kwargs):
    s = flow_sigmas(n, **kwargs)
    assert s.shape == (n + 1,)
    assert s[0].item() == 1.0 and s[-1].item() == 0.0
    assert bool((s[1:] < s[:-1]).all()), f"not strictly decreasing: {s}"


def test_flow_sigmas_shift_by_hand():
    # shift 3: 3s / (1 + 2s) at s = 0.75, 0.5, 0.25 -> 2.25/2.5, 1.5/2, 0.75/1.5.
    _close(flow_sigmas(4, shift=3.0), [1.0, 0.9, 0.75, 0.5, 0.0], 1e-7)
    _close(flow_sigmas(4, shift=1.0), [1.0, 0.75, 0.5, 0.25, 0.0], 0.0)


def test_flow_sigmas_mu_by_hand():
    # exp(mu) / (exp(mu) + 1/s - 1): mu = 0 is the identity; exp(mu) = 3 gives 3 / (3 + 1/3) = 0.9,
    # 3 / (3 + 1) = 0.75, 3 / (3 + 3) = 0.5 (the same values as the static shift 3).
    _close(flow_sigmas(4, mu=0.0), [1.0, 0.75, 0.5, 0.25, 0.0], 1e-7)
    _close(flow_sigmas(4, mu=math.log(3.0)), [1.0, 0.9, 0.75, 0.5, 0.0], 1e-7)
    # exp(1) / (exp(1) + 1) at s = 0.5.
    assert flow_sigmas(2, mu=1.0)[1].item() == pytest.approx(math.e / (math.e + 1.0), abs=1e-7)


def test_flow_sigmas_errors():
    with pytest.raises(ValueError, match=r"shift=2\.0.*mu=0\.5"):
        flow_sigmas(10, shift=2.0, mu=0.5)
    for bad in (1, 0, -3, 2.0, True):
        with pytest.raises(ValueError, match="num_steps"):
            flow_sigmas(bad)
    with pytest.raises(ValueError, match="shift must be > 0"):
        flow_sigmas(10, shift=0.0)


def test_qwenimage_mu_by_hand():
    assert qwenimage_mu(256) == pytest.approx(0.5, abs=1e-12)
    assert qwenimage_mu(4096) == pytest.approx(1.15, abs=1e-12)
    assert qwenimage_mu(2176) == pytest.approx(0.825, abs=1e-12)  # midpoint of 256..4096
    # Qwen-Image's scheduler config: 256..8192 tokens, shift 0.5..0.9; 1024 tokens = a 512x512 image.
    assert qwenimage_mu(1024, 256, 8192, 0.5, 0.9) == pytest.approx(0.5 + 0.4 * 768 / 7936, abs=1e-12)


def test_flow_sigmas_match_diffusers_scheduler():
    np = pytest.importorskip("numpy")
    sched_mod = pytest.importorskip("diffusers.schedulers.scheduling_flow_match_euler_discrete")
    n = 10
    base = np.linspace(1.0, 1.0 / n, n)
    qwen = sched_mod.FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
    )
    mu = qwenimage_mu(1024, 256, 8192, 0.5, 0.9)
    qwen.set_timesteps(sigmas=base, mu=mu)
    # diffusers shifts in float32, we shift in float64 and round once: a few float32 ulps apart.
    torch.testing.assert_close(flow_sigmas(n, mu=mu), qwen.sigmas.cpu(), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        timesteps_from_sigmas(flow_sigmas(n, mu=mu)), qwen.timesteps.cpu(), atol=1e-3, rtol=0
    )
    sd3 = sched_mod.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sd3.set_timesteps(sigmas=base)
    torch.testing.assert_close(flow_sigmas(n, shift=3.0), sd3.sigmas.cpu(), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------- SDE step


def _ref_step(x, v, sigma, sigma_next, a, sub):
    """Flow-GRPO's step for one sample, written out with python-float coefficients (float64)."""
    dt = sigma_next - sigma
    std_t = math.sqrt(sigma / (1.0 - (sub if sigma == 1.0 else sigma))) * a
    mean = (
        x * (1.0 + std_t**2 / (2.0 * sigma) * dt) + v * (1.0 + std_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
    )
    return mean, std_t, std_t * math.sqrt(-dt)


def _inputs(batch=3, shape=(6, 4), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g, dtype=dtype)
    v = torch.randn(batch, *shape, generator=g, dtype=dtype)
    return x, v


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.1, 0.0)])
def test_sde_logprob_scalar_sigma_matches_normal(sigma, sigma_next):
    x, v = _inputs()
    a, sub = 0.7, 0.9
    x_prev = x + 0.3 * torch.randn_like(x)
    step = sde_step_with_logprob(x, v, sigma, sigma_next, a, sigma_one_substitute=sub, prev_sample=x_prev)
    assert isinstance(step, SDEStep)
    mean, std_t, scale = _ref_step(x, v, sigma, sigma_next, a, sub)
    if sigma == 1.0:  # the substitute is what keeps std_t finite: sqrt(1 / (1 - 0.9)) * 0.7.
        assert std_t == pytest.approx(math.sqrt(10.0) * 0.7, rel=1e-12)
    expected = torch.distributions.Normal(mean, scale).log_prob(x_prev).mean(dim=(1, 2))
    assert step.log_prob.shape == (3,) and step.log_prob.dtype == torch.float64
    _close(step.log_prob, expected)
    _close(step.prev_sample_mean, mean)
    _close(step.std_dev_t, torch.full((3,), std_t, dtype=torch.float64))
    _close(step.prev_sample, x_prev, 0.0)


def test_sde_logprob_per_sample_sigma_matches_normal():
    x, v = _inputs(batch=3)
    sigmas = flow_sigmas(4, shift=3.0).double()  # [1, 0.9, 0.75, 0.5, 0]
    sigma = sigmas[torch.tensor([0, 2, 3])]  # one sample at sigma == 1 (substitute sigmas[1] = 0.9)
    sigma_next = sigmas[torch.tensor([1, 3, 4])]
    a = 0.5
    x_prev = x + 0.2 * torch.randn_like(x)
    step = sde_step_with_logprob(
        x, v, sigma, sigma_next, a, sigma_one_substitute=sigmas[1], prev_sample=x_prev
    )
    for b in range(3):
        mean, std_t, scale = _ref_step(x[b], v[b], sigma[b].item(), sigma_next[b].item(), a, sigmas[1].item())
        expected = torch.distributions.Normal(mean, scale).log_prob(x_prev[b]).mean()
        _close(step.log_prob[b], expected)
        _close(step.prev_sample_mean[b], mean)
        _close(step.std_dev_t[b], std_t)
    assert torch.isfinite(step.log_prob).all()


def test_sde_sample_statistics_and_logprob_roundtrip():
    # 2 samples x 20000 elements each at different sigmas; the normalised noise must be N(0, 1).
    x, v = _inputs(batch=2, shape=(5000, 4), seed=1, dtype=torch.float32)
    sigma, sigma_next, a = torch.tensor([1.0, 0.5]), torch.tensor([0.8, 0.3]), 0.9
    g = torch.Generator().manual_seed(123)
    step = sde_step_with_logprob(x, v, sigma, sigma_next, a, sigma_one_substitute=0.8, generator=g)
    for b in range(2):
        mean, _, scale = _ref_step(
            x[b].double(), v[b].double(), sigma[b].item(), sigma_next[b].item(), a, 0.8
        )
        z = (step.prev_sample[b].double() - mean) / scale
        # n = 20000: std error of the mean 0.007 and of the std 0.005; 0.03 is > 4 standard errors,
        # while a wrong scale (e.g. a missing sqrt(-dt) = 0.45 or 0.71 here) misses by > 0.4.
        assert abs(z.mean().item()) < 0.03, f"sample {b}: empirical mean {z.mean().item()}"
        assert abs(z.std().item() - 1.0) < 0.03, f"sample {b}: empirical std {z.std().item()}"

    # Training re-evaluates the stored x_prev: the log-prob must be bit-identical to the rollout's.
    again = sde_step_with_logprob(
        x, v, sigma, sigma_next, a, sigma_one_substitute=0.8, prev_sample=step.prev_sample
    )
    torch.testing.assert_close(again.log_prob, step.log_prob, atol=0, rtol=0)

    # Same generator seed, same draw.
    g2 = torch.Generator().manual_seed(123)
    same = sde_step_with_logprob(x, v, sigma, sigma_next, a, sigma_one_substitute=0.8, generator=g2)
    torch.testing.assert_close(same.prev_sample, step.prev_sample, atol=0, rtol=0)


def test_sde_bf16_inputs_are_upcast():
    x, v = _inputs(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    step = sde_step_with_logprob(x, v, 0.5, 0.4, 0.7, sigma_one_substitute=0.9, generator=g)
    assert step.log_prob.dtype == torch.float32
    assert step.prev_sample.dtype == torch.float32 and step.prev_sample_mean.dtype == torch.float32
    again = sde_step_with_logprob(x, v, 0.5, 0.4, 0.7, sigma_one_substitute=0.9, prev_sample=step.prev_sample)
    torch.testing.assert_close(again.log_prob, step.log_prob, atol=0, rtol=0)


def test_sde_gradient_through_mean_only():
    x, v = _inputs()
    v.requires_grad_(True)
    x_prev = (x + 0.1).requires_grad_(True)
    step = sde_step_with_logprob(x, v, 0.5, 0.4, 0.7, sigma_one_substitute=0.9, prev_sample=x_prev)
    step.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert x_prev.grad is None


def test_sde_noise_level_must_be_positive():
    x, v = _inputs()
    for a in (0.0, -0.1):
        with pytest.raises(ValueError, match=r"noise_level.*ode_step"):
            sde_step_with_logprob(x, v, 0.5, 0.4, a, sigma_one_substitute=0.9)


def test_sde_bad_inputs():
    x, v = _inputs(batch=3)
    with pytest.raises(ValueError, match=r"sigma must be .*\[B\] = \[3\]"):
        sde_step_with_logprob(x, v, torch.tensor([0.5, 0.4]), 0.3, 0.7, sigma_one_substitute=0.9)
    with pytest.raises(ValueError, match="model_output shape"):
        sde_step_with_logprob(x, v[:, :2], 0.5, 0.4, 0.7, sigma_one_substitute=0.9)
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step_with_logprob(x, v, 0.5, 0.6, 0.7, sigma_one_substitute=0.9)
    with pytest.raises(ValueError, match="sigma_one_substitute"):
        sde_step_with_logprob(x, v, 1.0, 0.9, 0.7, sigma_one_substitute=1.0)


def test_ode_step_is_zero_noise_limit_of_sde_mean():
    x, v = _inputs()
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.2]), torch.tensor([0.9, 0.45, 0.0])
    ode = ode_step(x, v, sigma, sigma_next)
    dt = (sigma_next - sigma).double().view(3, 1, 1)
    _close(ode, x + v * dt, 1e-15)
    # mean - ode = O(std_t^2 |x, v|) = O(a^2 * 10 * 3) for these O(1) inputs (sigma/(1 - sigma) <= 10):
    # 3e-11 at a = 1e-6, below the 1e-10 bound; at a = 0.5 the gap is O(0.1), so the check can fail.
    tiny = sde_step_with_logprob(x, v, sigma, sigma_next, 1e-6, sigma_one_substitute=0.9, prev_sample=x)
    _close(tiny.prev_sample_mean, ode)
    big = sde_step_with_logprob(x, v, sigma, sigma_next, 0.5, sigma_one_substitute=0.9, prev_sample=x)
    assert (big.prev_sample_mean - ode).abs().max() > 1e-2
    _close(ode_step(x, v, 0.6, 0.45), x + v * -0.15, 1e-15)


# --------------------------------------------------------------------------------------------- advantages


def test_group_advantages_batch_std_by_hand():
    # Groups {0: [1, 3], 1: [2, 6]}: group means 2 and 4 -> centred [-1, 1, -2, 2].
    # Batch (population) std of [1, 3, 2, 6]: mean 3, squared deviations 4, 0, 1, 9 -> var 14/4 = 3.5.
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    denom = math.sqrt(3.5) + 1e-4  # 1.8709286...
    expected = [-1 / denom, 1 / denom, -2 / denom, 2 / denom]  # [-0.53449, 0.53449, -1.06899, 1.06899]
    _close(group_advantages(rewards, ids), expected)
    # Group ids need not be contiguous nor sorted.
    shuffled = group_advantages(rewards[[2, 0, 3, 1]], torch.tensor([-3, 7, -3, 7]))
    _close(shuffled, [expected[i] for i in (2, 0, 3, 1)])
    # float32 in, float32 out.
    assert group_advantages(rewards.float(), ids).dtype == torch.float32


def test_group_advantages_group_std_by_hand():
    # Per-group population stds: [1, 3] -> 1, [2, 6] -> 2.
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    expected = [-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001]  # [-0.99990, 0.99990, -0.99995, 0.99995]
    _close(group_advantages(rewards, ids, std="group"), expected)
    # Equal rewards within a group (std 0) give 0, not NaN.
    _close(
        group_advantages(
            torch.tensor([5.0, 5.0, 1.0], dtype=torch.float64), torch.tensor([0, 0, 1]), std="group"
        ),
        [0.0, 0.0, 0.0],
    )


def test_group_advantages_clipping():
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    denom = math.sqrt(3.5) + 1e-4
    # +-2/denom = +-1.069 exceed clip 1 on both sides; +-0.534 stay.
    _close(group_advantages(rewards, ids, clip=1.0), [-1 / denom, 1 / denom, -1.0, 1.0])
    # One group of 30, one reward 1 and the rest 0: mean 1/30, std sqrt(29)/30, so the outlier's
    # z-score is sqrt(29) = 5.385 > 5 -> clipped to 5; the others are -1 / (sqrt(29) + 0.003).
    r = torch.zeros(30, dtype=torch.float64)
    r[-1] = 1.0
    adv = group_advantages(r, torch.zeros(30, dtype=torch.long))
    _close(adv[-1], 5.0)
    _close(adv[:-1], torch.full((29,), -1.0 / (math.sqrt(29.0) + 30e-4), dtype=torch.float64))


def test_group_advantages_errors():
    r = torch.zeros(4)
    with pytest.raises(ValueError, match="group_ids shape"):
        group_advantages(r, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(r, torch.zeros(4))
    with pytest.raises(ValueError, match="std must be one of"):
        group_advantages(r, torch.zeros(4, dtype=torch.long), std="global")


# --------------------------------------------------------------------------------------------- loss


def test_loss_on_policy():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(8, generator=g).requires_grad_(True)
    adv = torch.randn(8, generator=g)
    loss, m = flowgrpo_loss(lp, lp.detach().clone(), adv, clip_range=1e-4)
    assert m["ratio_mean"].item() == 1.0 and m["ratio_std"].item() == 0.0
    assert m["ppo_kl"].item() == 0.0 and m["clipfrac"].item() == 0.0
    torch.testing.assert_close(m["policy_loss"], -adv.mean(), atol=0, rtol=0)
    torch.testing.assert_close(loss.detach(), -adv.mean(), atol=0, rtol=0)
    assert m["kl"].item() == 0.0
    assert all(not t.requires_grad for t in m.values())
    # On-policy the ratio is inside the clip range, so d loss / d log_prob_i = -A_i * r_i / B = -A_i / B.
    loss.backward()
    _close(lp.grad, -adv / 8, 1e-7)


def test_loss_off_policy_by_hand():
    # clip_range 0.2 -> clamp(r) to [0.8, 1.2]; per sample -A*r vs -A*clamp(r), the max wins:
    #   A=+1, r=1.5: -1.5 vs -1.2 -> -1.2  (clipped: A > 0, r above 1 + eps, no gradient)
    #   A=+2, r=0.5: -1.0 vs -1.6 -> -1.0  (unclipped: A > 0, r below 1 - eps, pessimistic side)
    #   A=-1, r=0.5: +0.5 vs +0.8 -> +0.8  (clipped: A < 0, r below 1 - eps, no gradient)
    #   A=-2, r=1.5: +3.0 vs +2.4 -> +3.0  (unclipped: A < 0, r above 1 + eps)
    #   A=+1, r=1.1: -1.1 vs -1.1 -> -1.1  (inside the range)
    # pg = (-1.2 - 1.0 + 0.8 + 3.0 - 1.1) / 5 = 0.1
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, -1.0, -2.0, 1.0], dtype=torch.float64)
    old = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5], dtype=torch.float64).requires_grad_(True)
    lp = (old.detach() + ratios.log()).requires_grad_(True)
    loss, m = flowgrpo_loss(lp, old, adv, clip_range=0.2, normalizer=4.0)
    _close(m["policy_loss"], 0.1)
    _close(m["loss"], 0.1)
    _close(loss.detach(), 0.025)
    _close(m["ppo_kl"], -(2 * math.log(1.5) + 2 * math.log(0.5) + math.log(1.1)) / 5)
    _close(m["clipfrac"], 0.8)  # |r - 1| > 0.2 for all but r = 1.1
    _close(m["ratio_mean"], 1.02)  # 5.1 / 5
    # Population std: deviations 0.48, -0.52, -0.52, 0.48, 0.08 -> squares sum 1.008, / 5 = 0.2016.
    _close(m["ratio_std"], math.sqrt(0.2016))
    # The gradient reaches log_prob only through r (d r / d log_prob = r), and only for unclipped terms:
    # d loss / d lp_i = -A_i * r_i / (B * normalizer) = [0, -1.0, 0, 3.0, -1.1] / 20.
    loss.backward()
    _close(lp.grad, [0.0, -0.05, 0.0, 0.15, -0.055])
    assert old.grad is None


def test_loss_kl_by_hand():
    # Sample 0: diffs all 1 -> mean sq 1, std_t 0.5 -> 1 / (2 * 0.25) = 2.
    # Sample 1: diffs [0, 2, 0, 0] -> mean sq 1, std_t 1 -> 1 / 2 = 0.5.  kl = (2 + 0.5) / 2 = 1.25.
    ref = torch.zeros(2, 2, 2, dtype=torch.float64)
    diff = torch.tensor([[[1.0, 1.0], [1.0, 1.0]], [[0.0, 2.0], [0.0, 0.0]]], dtype=torch.float64)
    mean_new = (ref + diff).requires_grad_(True)
    std = torch.tensor([0.5, 1.0], dtype=torch.float64)
    lp = torch.zeros(2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)  # on-policy, pg = -mean(A) = 0
    loss, m = flowgrpo_loss(
        lp,
        lp,
        adv,
        clip_range=1e-4,
        kl_coef=0.1,
        prev_sample_mean=mean_new,
        ref_prev_sample_mean=ref,
        std_dev_t=std,
    )
    _close(m["kl"], 1.25)
    _close(m["policy_loss"], 0.0)
    _close(loss.detach(), 0.125)
    # d/d mean = kl_coef * 2 diff / (n * 2 std^2 * B), n = 4 elements: 0.05 for sample 0, 0.025 for diff 2.
    loss.backward()
    expected = torch.tensor([[[0.05, 0.05], [0.05, 0.05]], [[0.0, 0.025], [0.0, 0.0]]], dtype=torch.float64)
    _close(mean_new.grad, expected)
    # std_dev_t as [B, 1, 1] (the reference's broadcast shape) or a scalar.
    _, m2 = flowgrpo_loss(
        lp,
        lp,
        adv,
        clip_range=1e-4,
        kl_coef=0.1,
        prev_sample_mean=mean_new,
        ref_prev_sample_mean=ref,
        std_dev_t=std.view(2, 1, 1),
    )
    _close(m2["kl"], 1.25)
    _, m3 = flowgrpo_loss(
        lp,
        lp,
        adv,
        clip_range=1e-4,
        kl_coef=0.1,
        prev_sample_mean=mean_new,
        ref_prev_sample_mean=ref,
        std_dev_t=0.5,
    )
    _close(m3["kl"], (2.0 + 2.0) / 2)


def test_loss_errors():
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="missing prev_sample_mean, ref_prev_sample_mean, std_dev_t"):
        flowgrpo_loss(lp, lp, lp, clip_range=0.1, kl_coef=0.01)
    with pytest.raises(ValueError, match=r"old_log_prob must have shape \[B\] = \[3\]"):
        flowgrpo_loss(lp, torch.zeros(2), lp, clip_range=0.1)
    with pytest.raises(ValueError, match="advantages"):
        flowgrpo_loss(lp, lp, torch.zeros(3, 1), clip_range=0.1)
    with pytest.raises(ValueError, match="clip_range"):
        flowgrpo_loss(lp, lp, lp, clip_range=0.0)
    with pytest.raises(ValueError, match="ref_prev_sample_mean shape"):
        flowgrpo_loss(
            lp,
            lp,
            lp,
            clip_range=0.1,
            kl_coef=0.01,
            prev_sample_mean=torch.zeros(3, 4),
            ref_prev_sample_mean=torch.zeros(3, 5),
            std_dev_t=torch.ones(3),
        )


def test_loss_bf16_log_prob_metrics_in_float32():
    lp = torch.zeros(4, dtype=torch.bfloat16)
    loss, m = flowgrpo_loss(lp, lp, torch.ones(4), clip_range=0.1)
    assert loss.dtype == torch.float32 and all(t.dtype == torch.float32 for t in m.values())
