"""GRPO-Guard, flow_grpo's ``timestep_fraction`` and per-sample SDE windows against their reference code, one
process, CPU.

The references are re-implemented here from their formulas, independently of the package: flow_grpo's
``scripts/train_sd3_GRPO_Guard.py`` loop (its ``std_dev_t`` / ``sqrt_dt`` of shape ``[B, 1, 1]``, its ratio-mean bias
reduced by ``.mean(dim=tuple(range(1, log_prob.ndim)))``, which for the ``[B]`` log-prob is ``dim=()``: every dim),
verl-omni's ``GRPOGuardLoss`` (one bias per sample), and flow_grpo's ``PerPromptStatTracker`` with ``global_std =
False``.

Tolerances: everything runs in float64 on O(1) values except the velocity, which ``rollout.velocity`` returns in
float32 (both sides take the same one); the two sides then differ by float64 rounding only (~1e-15 relative), and the
ratio normalisation amplifies the log-ratio by ``S`` < 1 and the loss by ``1 / mean(sqrt(-dt))^2`` <= 1e3 (a
last step's sqrt(-dt) >= 0.03 here), so 1e-9 relative still catches any formula error (>= 1e-4). The rollout checks
are exact (``torch.equal``): a sample's own steps are the same arithmetic whatever the others do.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.base import StepContext
from sp_diffusers.flowgrpo.algorithms.dance_grpo import DanceGRPO
from sp_diffusers.flowgrpo.algorithms.flow_grpo import FlowGRPO
from sp_diffusers.flowgrpo.algorithms.grpo_guard import GRPOGuard, grpo_guard_loss
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
from sp_diffusers.flowgrpo.models.base import FamilyAdapter
from sp_diffusers.flowgrpo.sampling.denoise import Sampler, Span, denoise
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import pipeline_schedule
from sp_diffusers.flowgrpo.sampling.sde import StepRule, ode_step
from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory
from sp_diffusers.flowgrpo.update import step_loss


def _samples(n: int, prompt: str = "a"):
    """A batch of ``n`` samples for an algorithm's plan (prompts only: nothing is encoded)."""
    from sp_diffusers.flowgrpo.batch import IterationBatch

    return IterationBatch([prompt] * n, {}, torch.arange(n), torch.zeros(n))

REL = 1e-9
NOISE = 0.7


def _close(actual, expected, rel=REL):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * expected.abs().max().item())


def _config(**flowgrpo) -> TrainConfig:
    c = TrainConfig()
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


# --------------------------------------------------------------------------------------------- a model stand-in


class _Model(torch.nn.Module):
    def __init__(self, w: float = 0.3) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))


class _Engine:
    """``engine.forward`` of a velocity that is a per-sample function of its inputs (no reduction across the batch),
    so a sample's numbers do not depend on the rest of the batch; LoRA's switch flips ``w`` (the reference)."""

    num_experts = 1

    def __init__(self, w: float = 0.3) -> None:
        self.model = _Model(w)
        self.off = False

    def for_step(self, step: int) -> _Engine:
        return self

    def forward(self, hidden_states, timestep, text):
        w = self.model.w * (0.5 if self.off else 1.0)
        t = timestep.reshape(-1, *([1] * (hidden_states.ndim - 1))) if timestep.ndim else timestep
        return w * torch.sin(hidden_states) - hidden_states + (t / 1000) * text[:, :1, :1].to(hidden_states.dtype)

    @contextlib.contextmanager
    def adapters_disabled(self):
        self.off = True
        try:
            yield
        finally:
            self.off = False


class _Adapter(FamilyAdapter):
    def inputs(self, x, t, embeds, mask, pooled=None):
        return {"hidden_states": x, "timestep": t, "text": embeds}


def _cond(b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_embeds": torch.randn(b, 3, 4, generator=g), "prompt_embeds_mask": torch.ones(b, 3, dtype=torch.bool)}


# ------------------------------------------------------------------------------------------- the references


def _std_dev_t(sigmas: torch.Tensor, i: int, a: float) -> float:
    """flow_grpo: sqrt(sigma / (1 - where(sigma == 1, sigmas[1], sigma))) * noise_level."""
    sigma = sigmas[i].item()
    return math.sqrt(sigma / (1 - (sigmas[1].item() if sigma == 1 else sigma))) * a


def _flow_grpo_guard(lp, old, adv, mean, old_mean, std_b11, sqrt_dt_b11, clip):
    """flow_grpo's GRPO-Guard loop lines for one trained step j (rationorm on, beta 0)."""
    sigma_t = std_b11.mean()
    bias = (mean - old_mean).pow(2).mean(dim=tuple(range(1, lp.ndim)))  # lp is [B]: dim=() -> a scalar
    bias = bias / (2 * (sqrt_dt_b11.mean() * sigma_t) ** 2)
    ratio = torch.exp((lp - old + bias) * (sqrt_dt_b11.mean() * sigma_t))
    loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)))
    return loss / sqrt_dt_b11.mean() ** 2, ratio


def _verl_omni_guard(lp, old, adv, mean, old_mean, std_b11, sqrt_dt_b, clip):
    """verl-omni's GRPOGuardLoss.compute_loss (no rollout-correction weights)."""
    scale = sqrt_dt_b.mean() * std_b11.mean()
    bias = (mean - old_mean).pow(2).mean(dim=tuple(range(1, mean.ndim))) / (2 * scale**2)
    ratio = torch.exp((lp - old + bias) * scale)
    loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)))
    return loss / sqrt_dt_b.mean() ** 2, ratio


def _per_prompt_advantages(prompts, rewards):
    """flow_grpo's PerPromptStatTracker.update (global_std False), then the loop's clamp to +-5."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    out = np.empty_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        out[prompts == p] = (r - np.mean(r)) / (np.std(r) + 1e-4)
    return np.clip(out, -5, 5)


# ------------------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("step", [0, 8, 9], ids=["first", "last_trained", "last"])
@pytest.mark.parametrize("bias", ["batch", "sample"])
def test_guard_loss_matches_both_references(step, bias):
    """At the first step (sigma = 1: flow_grpo's sigmas[1] substitute), the last one 0.99 N trains, and the very last
    (sigma' = 0); ``guard.bias: batch`` is flow_grpo's script, ``sample`` verl-omni's."""
    sigmas = pipeline_schedule("sd3", 10).sigmas.double()
    g = torch.Generator().manual_seed(step)
    b = 6
    mean = torch.randn(b, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    old_mean = (mean + 0.05 * torch.randn(b, 5, 4, generator=g, dtype=torch.float64)).detach()
    lp = torch.randn(b, generator=g, dtype=torch.float64)
    old = lp + 1e-3 * torch.randn(b, generator=g, dtype=torch.float64)
    lp = lp.requires_grad_()
    adv = torch.tensor([1.5, -0.5, 0.0, -2.0, 0.7, -5.0], dtype=torch.float64)
    std = torch.full((b,), _std_dev_t(sigmas, step, NOISE), dtype=torch.float64)
    sqrt_dt = torch.full((b,), math.sqrt(sigmas[step].item() - sigmas[step + 1].item()), dtype=torch.float64)
    clip = 2e-6 if step else 0.02  # the reference's clip; at step 0 a wide one, so both branches are taken
    ours, m = grpo_guard_loss(lp, old, adv, mean, old_mean, std, sqrt_dt, clip_range=clip, normalizer=3.0, bias=bias)
    ref_fn = _flow_grpo_guard if bias == "batch" else _verl_omni_guard
    ref, ratio = ref_fn(
        lp,
        old,
        adv,
        mean,
        old_mean,
        std[:, None, None],
        sqrt_dt if bias == "sample" else sqrt_dt[:, None, None],
        clip,
    )
    _close(ours * 3.0, ref)
    _close(m["ratio_mean"], ratio.mean())
    g_ours = torch.autograd.grad(ours * 3.0, (lp, mean))
    g_ref = torch.autograd.grad(ref, (lp, mean))
    for a, e in zip(g_ours, g_ref, strict=True):
        _close(a, e)
    assert g_ours[1].abs().max() > 0  # the bias carries gradient to the step mean
    if bias == "sample":  # the two references differ: flow_grpo shares one bias across the micro-batch
        other, _ = _flow_grpo_guard(
            lp, old, adv, mean, old_mean, std[:, None, None], sqrt_dt[:, None, None], clip
        )
        assert (other - ref).abs() > 1e-6 * ref.abs()


def test_guard_loss_on_policy_equal_and_negative_rewards():
    """On-policy (mean = mean_old, log p = log p_old) the ratio is exactly 1 and the loss -mean(A) / mean(sqrt(-dt))^2;
    a group of equal rewards has advantages 0 and gives nothing; a group of only negative rewards is centred."""
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.3, -2.0, -1.0, -0.5, -0.25], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    guard = GRPOGuard(_config(algorithm="grpo_guard"))
    adv = guard.advantages(rewards, groups)
    _close(adv, _per_prompt_advantages(groups.tolist(), rewards.tolist()))
    assert adv[:4].abs().max().item() == 0.0 and adv[4:].sum().abs().item() < 1e-12
    assert (adv[4:] > 0).sum() == 2  # centred on the group's own mean, not on 0
    mean = torch.randn(8, 4, 3, dtype=torch.float64, requires_grad=True)
    lp = torch.randn(8, dtype=torch.float64, requires_grad=True)
    std, sqrt_dt = torch.full((8,), 0.9, dtype=torch.float64), torch.full((8,), 0.2, dtype=torch.float64)
    loss, m = grpo_guard_loss(lp, lp.detach(), adv, mean, mean.detach(), std, sqrt_dt, clip_range=2e-6)
    assert (
        m["ratio_mean"].item() == 1.0 and m["ratio_std"].item() == 0.0 and m["ratio_mean_bias"].item() == 0.0
    )
    assert m["ppo_kl"].item() == 0.0 and m["clipfrac"].item() == 0.0
    _close(loss, -adv.mean() / 0.04)
    # d rho / d log p = S = 0.9 * 0.2 at rho = 1, and the equal-reward samples get no gradient
    grad = torch.autograd.grad(loss, lp)[0]
    _close(grad, -adv * 0.18 / 8 / 0.04)
    assert grad[:4].abs().max().item() == 0.0


def test_guard_loss_refuses_what_it_cannot_use():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="bias='mean'"):
        grpo_guard_loss(x[:, 0], x[:, 0], x[:, 0], x, x, x[:, 0], x[:, 0], clip_range=1e-3, bias="mean")
    with pytest.raises(ValueError, match=r"same \[B, \.\.\.\] with B = 2"):
        grpo_guard_loss(x[:, 0], x[:, 0], x[:, 0], x, x[:1], x[:, 0], x[:, 0], clip_range=1e-3)


# ----------------------------------------------------------------------------------- the step loss of the seam


def _step_case(per_sample: bool, kl: float = 0.0):
    """A stored 2-step window per sample (one start, or each sample its own) and the guard's context."""
    n, w, b = 8, 2, 4
    schedule = pipeline_schedule("sd3", n)
    c = _config(
        algorithm="grpo_guard",
        sde_steps="window",
        num_steps=n,
        window_size=w,
        window_range=[0, n - w + 1],
        noise_level=NOISE,
        clip_range=5e-3,
        kl_coef=kl,
    )
    starts = torch.tensor([0, 6, 3, 1]) if per_sample else torch.full((b,), 2)
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(b, w + 1, 5, 4, generator=g, dtype=torch.float64)
    traj = Trajectory(
        latents,
        torch.zeros(b, w),
        int(starts.min()),
        latents[:, -1],
        train_steps=starts[:, None] + torch.arange(w),
        starts=starts,
    )
    traj.old_means = latents[:, 1:] + 0.03 * torch.randn(b, w, 5, 4, generator=g, dtype=torch.float64)
    old = torch.randn(b, w, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    rule = StepRule("sde", NOISE)
    ctx = StepContext(_Adapter(), schedule, rule, c)
    return c, schedule, traj, old, adv, ctx, _cond(b)


@pytest.mark.parametrize("per_sample", [False, True], ids=["shared_window", "per_sample_windows"])
def test_guard_step_loss_matches_verl_omni_through_the_seam(per_sample):
    """``GRPOGuard`` through the update's ``step_loss`` (the evaluation, the step's std_dev_t and sqrt(-dt) from the schedule, the loss) against
    verl-omni's formula on the same velocities; with per-sample windows the rows sit at different steps and the scale
    is the micro-batch mean, as verl-omni takes it."""
    c, schedule, traj, old, adv, ctx, cond = _step_case(per_sample)
    engine = _Engine()
    guard = GRPOGuard(c)
    sigmas = schedule.sigmas.double()
    idx = torch.tensor([0, 1, 2, 3])
    for k in range(2):
        steps = traj.steps()[:, k]
        x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
        t = schedule.timesteps[steps]
        v = engine.forward(x, t, cond["prompt_embeds"].double()).float().double()
        mus, lps, stds, sqrt_dts = [], [], [], []
        for row, i in enumerate(steps.tolist()):
            sigma, nxt = sigmas[i].item(), sigmas[i + 1].item()
            std = _std_dev_t(sigmas, i, NOISE)
            dt = nxt - sigma
            mu = (
                x[row] * (1 + std**2 / (2 * sigma) * dt)
                + v[row] * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
            )
            s = std * math.sqrt(-dt)
            lp = (
                -((x_next[row] - mu) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))
            ).mean()
            (
                mus.append(mu.detach()),
                lps.append(lp.detach()),
                stds.append(std),
                sqrt_dts.append(math.sqrt(-dt)),
            )
        # the old policy near the current one: some ratios inside the clip range, some outside
        drift = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        traj.old_means[:, k] = torch.stack(mus) + 0.01 * drift
        old[:, k] = torch.stack(lps) - torch.tensor([0.002, -0.3, 0.1, -0.01], dtype=torch.float64)
        loss, m = step_loss(
            engine,
            algorithm=guard,
            ctx=ctx,
            traj=traj,
            k=k,
            idx=idx,
            cond=cond,
            advantages=adv,
            old_log_probs=old,
            normalizer=4.0,
        )
        ref, ratio = _verl_omni_guard(
            torch.stack(lps),
            old[:, k],
            adv,
            torch.stack(mus),
            traj.old_means[:, k],
            torch.tensor(stds, dtype=torch.float64)[:, None, None],
            torch.tensor(sqrt_dts, dtype=torch.float64),
            5e-3,
        )
        _close(loss * 4.0, ref)
        _close(m["ratio_mean"], ratio.mean())
        assert 0 < m["clipfrac"].item() < 1  # both branches of the clip are exercised
        g = torch.autograd.grad(loss * 4.0, engine.model.w)[0]
        assert g.abs().item() > 0


def test_guard_step_loss_kl_is_flow_grpos():
    """beta > 0: flow_grpo's KL (to the adapters-off model), mean((mu - mu_ref)^2) / (2 std_dev_t^2), added as is."""
    c, schedule, traj, old, adv, ctx, cond = _step_case(False, kl=0.04)
    engine = _Engine()
    guard = GRPOGuard(c)
    idx = torch.arange(4)
    _, m = step_loss(
        engine,
        algorithm=guard,
        ctx=ctx,
        traj=traj,
        k=1,
        idx=idx,
        cond=cond,
        advantages=adv,
        old_log_probs=old,
        normalizer=1.0,
    )
    rule, step = StepRule("sde", NOISE), 3
    x, x_next = traj.latents[:, 1], traj.latents[:, 2]
    t = schedule.timesteps[step]
    v = engine.forward(x, t, cond["prompt_embeds"].double()).float().double()
    with engine.adapters_disabled():
        v_ref = engine.forward(x, t, cond["prompt_embeds"].double()).float().double()
    mu = rule.step(x, v, schedule.sigmas, step, prev_sample=x_next)
    mu_ref = rule.step(x, v_ref, schedule.sigmas, step, prev_sample=x_next)
    std = _std_dev_t(schedule.sigmas.double(), step, NOISE)
    kl = ((mu.prev_sample_mean - mu_ref.prev_sample_mean) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * std**2)
    _close(m["kl"], kl.mean())
    _close(m["loss"], m["policy_loss"] + 0.04 * kl.mean())


# ----------------------------------------------------------------- timestep_fraction and the windows' draws


@pytest.mark.parametrize(("algorithm", "fraction", "trained"), [
    ("grpo_guard", 0.0, 9), ("flow_grpo", 0.0, 9), ("grpo_guard", 1.0, 10), ("flow_grpo", 0.5, 5), ("grpo_guard", 0.35, 3)
])
def test_timestep_fraction_trains_the_first_steps_in_order(algorithm, fraction, trained):
    """flow_grpo's train_sd3 loop trains ``range(int(N * timestep_fraction))`` of a full-SDE rollout; 0 means the
    reference configs' 0.99 (DanceGRPO keeps its own 0.6)."""
    c = _config(algorithm=algorithm, sde_steps="all", num_steps=10, timestep_fraction=fraction)
    cls = GRPOGuard if algorithm == "grpo_guard" else FlowGRPO
    cls.check(c)
    batch = _samples(3)
    cls(c).plan(batch, torch.Generator().manual_seed(0), 0, torch.Generator())
    assert batch.plan.train_steps.tolist() == [list(range(trained))] * 3
    assert batch.plan.host_steps == list(range(trained))
    span = cls(c).span(batch.plan, pipeline_schedule("sd3", 10))
    assert (span.start, span.size) == (0, 10)
    assert DanceGRPO.timestep_fraction(_config(algorithm="dance_grpo")) == 0.6


def test_per_sample_windows_draw_every_start_each_from_its_own_generator():
    """verl-omni's start = randint(r0, r1 - W + 1) per row: ours draws from [lo, hi) (hi = r1 - W + 1), reaches both
    ends, gives every sample W steps, and a sample's start does not depend on how many samples share the batch."""
    n, w = 8, 3
    c = _config(
        sde_steps="window", per_sample_windows=True, num_steps=n, window_size=w, window_range=[0, n - w + 1]
    )
    FlowGRPO.check(c)
    algo = FlowGRPO(c)
    seen = set()
    for seed in range(40):
        small, large = _samples(4), _samples(9)
        algo.plan(small, torch.Generator().manual_seed(seed), 0, torch.Generator())
        algo.plan(large, torch.Generator().manual_seed(seed), 0, torch.Generator())
        assert large.plan.window_starts[:4] == small.plan.window_starts
        seen.update(large.plan.window_starts)
        steps = large.plan.train_steps
        assert torch.equal(steps, torch.tensor(large.plan.window_starts)[:, None] + torch.arange(w))
        span = algo.span(large.plan, pipeline_schedule("sd3", n))
        assert (span.start, span.size) == (large.plan.window_starts, w)
    assert seen == set(range(n - w + 1))  # both ends: the first step and a window ending at the last step


@pytest.mark.parametrize(("keys", "words"), [
    ({"sde_steps": "some"}, r"flowgrpo\.sde_steps='some'.*'window'.*'all'"),
    ({"sde_steps": "all", "per_sample_windows": True}, r"flowgrpo\.per_sample_windows=true.*sde_steps=window"),
    ({"algorithm": "grpo_guard", "per_sample_windows": True}, r"resolves to 'all'.*grpo_guard"),
    ({"sde_steps": "all", "timestep_fraction": 1.5}, r"flowgrpo\.timestep_fraction=1\.5 must be in \(0, 1\]"),
    ({"sde_steps": "all", "timestep_fraction": 0.05}, r"timestep_fraction=0\.05 x num_steps=8 trains no step"),
    ({"sde_steps": "all", "sde_type": "cps", "kl_coef": 0.1, "timestep_fraction": 1.0}, r"trains the last step"),
    ({"algorithm": "grpo_guard", "sde_type": "cps"}, r"flowgrpo\.sde_type='cps'.*fix: flowgrpo\.sde_type=sde"),
    ({"algorithm": "grpo_guard", "guard.bias": "mean"}, r"flowgrpo\.guard.bias='mean'.*'sample'.*'batch'"),
])
def test_bad_keys_are_named_with_the_fix(keys, words):
    from sp_diffusers.flowgrpo.build import check_algorithm

    with pytest.raises(ConfigError, match=words):
        check_algorithm(_config(**keys))


def test_two_experts_refuse_per_sample_windows_and_share_the_first_steps():
    c = _config(sde_steps="window", per_sample_windows=True)
    with pytest.raises(
        ConfigError, match=r"per_sample_windows=true with two experts.*per_sample_windows=false"
    ):
        FlowGRPO(c).share_plan(_samples(2), {0, 1, 2, 3}, torch.Generator())
    c = _config(algorithm="grpo_guard", num_steps=8)  # first 7 steps trained; the trained expert runs 4..7
    batch = _samples(2)
    GRPOGuard(c).share_plan(batch, {4, 5, 6, 7}, torch.Generator())
    assert batch.plan.host_steps == [4, 5, 6] and batch.plan.train_steps.tolist() == [[4, 5, 6]] * 2
    with pytest.raises(ConfigError, match=r"none of the trained steps 0\.\.6"):
        GRPOGuard(c).check_trainable({7}, {7: "transformer_2"}, ["transformer_2"])


# ------------------------------------------------------------------------------------ per-sample rollouts


def _rollout(starts, w=2, n=6, keep_means=False, device="cpu", seed=5):
    engine, b = _Engine(), len(starts) if not isinstance(starts, int) else 4
    noise = torch.randn(b, 5, 4, generator=torch.Generator().manual_seed(1)).to(device)
    schedule = pipeline_schedule("sd3", n)
    cond = {k: v.to(device) for k, v in _cond(b).items()}
    traj = denoise(
        Sampler(engine, _Adapter(), schedule),
        cond,
        noise,
        Span(starts, w, StepRule("sde", NOISE)),
        torch.Generator().manual_seed(seed),
        keep_means=keep_means,
    )
    return traj, engine, noise, schedule, cond


def test_per_sample_rollout_with_one_start_is_the_shared_rollout():
    shared = _rollout(2, keep_means=True)[0]
    mine = _rollout([2, 2, 2, 2], keep_means=True)[0]
    for name in ("latents", "log_probs", "final", "means"):
        assert torch.equal(getattr(mine, name), getattr(shared, name)), name
    assert torch.equal(mine.steps(), shared.steps()) and torch.equal(
        mine.rollout_means(), shared.rollout_means()
    )


def test_per_sample_rollout_is_each_samples_own_rollout():
    """Windows at both ends (start 0, and one ending at the last step) and between: for each sample, its ODE steps
    before the window give its first stored latent, its SDE steps give the stored log-probs and means, and its ODE
    steps after the window give its final latent, bit for bit."""
    n, w = 6, 2
    starts = [0, 4, 2, 1]
    traj, engine, noise, schedule, cond = _rollout(starts, w, n, keep_means=True)
    rule, sigmas = StepRule("sde", NOISE), schedule.sigmas
    assert torch.equal(traj.steps(), torch.tensor(starts)[:, None] + torch.arange(w))

    def v(x, i, row):
        return engine.forward(x.double(), schedule.timesteps[i], cond["prompt_embeds"][row : row + 1]).float()

    for row, s in enumerate(starts):
        x = noise[row : row + 1].float()
        for i in range(s):
            x = ode_step(x, v(x, i, row), float(sigmas[i]), float(sigmas[i + 1]))
        assert torch.equal(traj.latents[row, 0], x[0]), row
        for p in range(w):
            x, nxt = traj.latents[row : row + 1, p], traj.latents[row : row + 1, p + 1]
            step = rule.step(x, v(x, s + p, row), sigmas, s + p, prev_sample=nxt)
            assert torch.equal(step.log_prob[0], traj.log_probs[row, p]), (row, p)
            assert torch.equal(step.prev_sample_mean[0], traj.means[row, p]), (row, p)
        x = traj.latents[row : row + 1, w]
        for i in range(s + w, n):
            x = ode_step(x, v(x, i, row), float(sigmas[i]), float(sigmas[i + 1]))
        assert torch.equal(traj.final[row], x[0]), row
    assert torch.equal(traj.rollout_log_probs(), traj.log_probs)
    idx = torch.tensor([3, 1])
    steps, lat, nxt = traj.step_latents(idx, 1)
    assert (
        steps.tolist() == [2, 5]
        and torch.equal(lat, traj.latents[idx, 1])
        and torch.equal(nxt, traj.latents[idx, 2])
    )


def test_per_sample_rollout_never_reads_the_device():
    """On the meta device any read of a device value to the host raises: the per-sample rollout (its tables, masks,
    stores) runs there to the end, so a GPU rollout never waits on the device for its bookkeeping."""
    traj = _rollout([0, 4, 2, 1], keep_means=True, device="meta")[0]
    assert traj.latents.device.type == "meta" and traj.latents.shape == (4, 3, 5, 4)
    assert traj.steps().device.type == "meta" and traj.rollout_means().shape == (4, 2, 5, 4)
    with pytest.raises((RuntimeError, NotImplementedError)):
        traj.latents.sum().item()  # the probe itself: a read does raise here
