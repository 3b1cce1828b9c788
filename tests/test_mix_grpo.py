"""MixGRPO against its reference code (Tencent-Hunyuan/MixGRPO), re-implemented here from the reference's formulas and
control flow, independently of sp_diffusers' code: the window schedule (``grpo_states.GRPOTrainingStates``), the
loss (``train_grpo_flux.train_one_step``), the advantages and the config's checks. One process, CPU. Its DPM-Solver++
tail and the rollout around the window: tests/test_mix_grpo_tail.py.

Tolerances: the window schedule is integers: compared exactly, at every iteration of several full cycles; the loss
and the advantages run in float64 on O(1) values and agree with the reference's formulas to float64 rounding,
~1e-15 relative; 1e-10 still catches any formula error: the loss's smallest term, the KL's
0.3 x 0.5 mean((lp - lp_old)^2) / 6 ~ 7e-9 in test_loss_is_the_references, is 70 times that.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.base import StepContext
from sp_diffusers.flowgrpo.algorithms.mix_grpo import MixGRPO, MixWindows
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule
from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory
from sp_diffusers.flowgrpo.update import step_loss

from .test_mix_grpo_tail import _COND, _Adapter, _Engine, _Model

F64 = 1e-10


def _mix_config(**keys) -> TrainConfig:
    c = TrainConfig()
    c.flowgrpo.algorithm, c.flowgrpo.shift = "mix_grpo", 3.0
    for k, v in keys.items():  # an algorithm's section: mix={"window_size": 2}, or "mix.window_size"=2
        if isinstance(v, dict):
            for key, value in v.items():
                setattr(getattr(c.flowgrpo, k), key, value)
        elif "." in k:
            section, key = k.split(".")
            setattr(getattr(c.flowgrpo, section), key, v)
        else:
            setattr(c.flowgrpo, k, v)
    return c


# ------------------------------------------------------------------------------------------------ the window


class _ReferenceStates:
    """GRPOTrainingStates' update_iteration / get_current_timesteps, as the reference writes them (numpy exp and
    ceil; the state lives in two counters; ``random`` draws from the generator it is given)."""

    def __init__(self, ipg, size, max_t, strategy, overlap, overlap_step, ipg_max, ipg_min, roll_back, thr, k):
        self.ipg, self.size, self.max_t, self.strategy = ipg, size, max_t, strategy
        self.overlap, self.overlap_step, self.roll_back = overlap, overlap_step, roll_back
        self.ipg_max, self.ipg_min, self.thr, self.k = ipg_max, ipg_min, thr, k
        self.cur, self.in_group = 0, 0

    def current(self) -> list[int]:
        return list(range(self.cur, min(self.cur + self.size, self.max_t)))

    def _limit(self):
        if self.strategy == "decay":
            progress = self.cur / self.max_t
            return max(self.ipg_min, int(self.ipg_max * (1 - progress) + self.ipg_min * progress))
        if self.strategy == "exp_decay":
            return np.ceil(self.ipg * np.exp(-self.k * max(0, self.cur - self.thr)))
        return self.ipg

    def update(self, rng=None) -> None:
        if self.strategy == "random":
            self.cur = int(rng.integers(0, self.max_t - self.size + 1))
            return
        self.in_group += 1
        if self.in_group >= self._limit():
            self.in_group = 0
            self.cur += self.overlap_step if self.overlap else self.size
        if self.cur > self.max_t:
            if self.roll_back:
                self.cur, self.in_group = 0, 0
            else:
                self.cur = self.max_t


CASES = [
    # (strategy, ipg, overlap, overlap_step, roll_back): the released FLUX script is ("progressive", 25, True, 1, True)
    ("progressive", 25, True, 1, True),
    ("progressive", 3, False, 1, True),
    ("progressive", 3, False, 1, False),
    ("progressive", 2, True, 3, False),
    ("progressive", 2, True, 0, True),  # MixGRPO-Flash*: a window that stays at 0
    ("decay", 25, False, 1, True),
    ("decay", 25, True, 1, False),
    ("exp_decay", 6, True, 1, True),
    ("exp_decay", 25, False, 1, False),
]


@pytest.mark.parametrize(("strategy", "ipg", "overlap", "step", "roll_back"), CASES)
def test_window_schedule_is_the_references(strategy, ipg, overlap, step, roll_back):
    n, size = 25, 4
    c = _mix_config(num_steps=n, mix=dict(window_size=size, strategy=strategy, iters_per_group=ipg, prog_overlap=overlap, prog_overlap_step=step, roll_back=roll_back))
    g = c.flowgrpo
    MixGRPO.check(c)
    ref = _ReferenceStates(
        ipg,
        size,
        n - 2,
        strategy,
        overlap,
        step,
        g.mix.max_iters_per_group,
        g.mix.min_iters_per_group,
        roll_back,
        g.mix.exp_decay_threshold,
        g.mix.exp_decay_k,
    )
    ours = MixWindows(g)
    # enough iterations to reach the end at least twice (the slowest case: 23 moves of 25 iterations)
    seen = []
    for it in range(1300):
        start, stop, in_group = ours.window(it, torch.Generator())
        assert list(range(start, stop)) == ref.current(), (it, start, stop, ref.cur)
        assert in_group == ref.in_group
        seen.append((start, stop))
        ref.update()
    assert seen[0] == (0, 4)  # the first iteration trains steps 0..3
    if step == 0 and overlap:
        assert set(seen) == {(0, 4)}
        return
    # the end: the window shrinks against step N - 2 = 23, which is never trained, and is empty there
    assert (20, 23) in seen or (21, 23) in seen
    if not roll_back:
        assert seen[-1] == (23, 23)  # clamped at the end: nothing left to train (the reference's "complete")
    elif (23, 23) in seen:
        after = seen.index((23, 23))
        while seen[after] == (23, 23):
            after += 1
        assert seen[after] == (0, 4)  # rolled back to the start


def test_window_schedule_ends_and_resume():
    """Both ends spelled out (progressive, stride 1, 2 iterations per position), and a window asked out of order
    (a resumed run) equal to the one reached in order."""
    c = _mix_config(num_steps=10, mix=dict(window_size=3, iters_per_group=2, prog_overlap=True, roll_back=True))
    w = MixWindows(c.flowgrpo)
    got = [w.window(i, torch.Generator())[:2] for i in range(20)]
    # max = 8: starts 0, 0, 1, 1, ..., 5, 5 (full windows), 6, 6 (steps 6, 7), 7, 7 (step 7), 8, 8 (none), 0, 0
    assert got[:2] == [(0, 3), (0, 3)] and got[10:12] == [(5, 8), (5, 8)]
    assert got[12:18] == [(6, 8), (6, 8), (7, 8), (7, 8), (8, 8), (8, 8)]
    assert got[18:] == [(0, 3), (0, 3)]
    fresh = MixWindows(c.flowgrpo)
    assert fresh.window(17, torch.Generator())[:2] == (8, 8) and fresh.window(3, torch.Generator())[:2] == (
        1,
        4,
    )


def test_random_windows_are_uniform_and_shared():
    c = _mix_config(num_steps=25, mix=dict(strategy="random"))
    w = MixWindows(c.flowgrpo)
    starts = [w.window(i, torch.Generator().manual_seed(1000 + i))[0] for i in range(600)]
    assert starts[0] == 0  # the reference's first iteration trains the initial window
    assert set(starts[1:]) == set(range(20))  # [0, max - W] = [0, 19], every value drawn
    counts = np.bincount(starts[1:], minlength=20)
    assert counts.min() >= 10  # ~30 each: a window drawn from a narrower range would miss this
    again = MixWindows(c.flowgrpo)
    assert [again.window(i, torch.Generator().manual_seed(1000 + i))[0] for i in range(600)] == starts


def test_the_window_is_the_same_on_every_data_parallel_rank(tmp_path):
    """The trainer seeds the window by the iteration alone: dp ranks 0 and 1 train the same steps on their own
    noise; with mix.same_noise the samples of a prompt share their first sample's noise."""
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = _mix_config(num_steps=12, mix=dict(strategy="random", same_noise=True))
    c.model.overrides = {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1
    c.train.out_dir, c.train.progress, c.train.plot = str(tmp_path), False, False
    trainer = FlowGRPOTrainer(c)
    batches = {}
    for dp_rank in (0, 1):
        trainer.engine.layout.dp_rank = dp_rank
        batches[dp_rank] = [trainer.iteration_batch(it) for it in range(1, 6)]
    trainer.engine.layout.dp_rank = 0
    for a, b in zip(batches[0], batches[1], strict=True):
        assert (a.plan.window_start, a.plan.window_size) == (b.plan.window_start, b.plan.window_size)
        assert not torch.equal(a.latents, b.latents)
        for first in range(0, 8, 4):  # group_size 4: one noise per group, another for the next group
            assert all(torch.equal(a.latents[first], a.latents[first + j]) for j in range(4))
        assert not torch.equal(a.latents[0], a.latents[4])
    assert len({b.plan.window_start for b in batches[0]}) > 1  # it moves between iterations


# ------------------------------------------------------------------------------------ the loss, advantages


def test_loss_is_the_references():
    """MixGRPO's loss through the update's step_loss in float64 against train_one_step's arithmetic: the ratio of flow_grpo_step's log-prob of
    the stored next latent to the rollout's, the clipped policy loss of the clamped advantages, plus kl_coeff *
    0.5 mean((lp - lp_old)^2), each divided by grad-accumulation x trained steps."""
    n, shift, eta, clip, kl_coeff, normalizer = 10, 3.0, 0.7, 1e-4, 0.3, 6.0
    c = _mix_config(num_steps=n, noise_level=eta, clip_range=clip, mix=dict(kl_coef=kl_coeff))
    algorithm = MixGRPO(c)
    model = _Model(4, torch.float64)
    schedule = linspace_schedule(n, shift)
    ctx = StepContext(_Adapter(), schedule, algorithm.step_rule(), c)
    g = torch.Generator().manual_seed(2)
    b, start = 4, 3
    latents = torch.randn(b, 3, 6, 4, generator=g, dtype=torch.float64)
    traj = Trajectory(latents, torch.zeros(b, 2, dtype=torch.float64), start, latents[:, -1])
    advantages = torch.tensor([0.8, -1.3, 7.0, -0.2], dtype=torch.float64).clamp(-5, 5)
    sig = schedule.sigmas.double()
    for k in range(2):
        i = start + k
        x, nxt = latents[:, k], latents[:, k + 1]
        with torch.no_grad():
            pred = model(x, schedule.timesteps[i].expand(b)).float().double()  # the model's float32 velocity
        sigma, dt = sig[i], sig[i + 1] - sig[i]
        std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sig[1], sigma))) * eta
        mean = x * (1 + std**2 / (2 * sigma) * dt) + pred * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std * torch.sqrt(-dt)
        lp = (
            -((nxt - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
        ).mean((1, 2))
        old = lp - torch.tensor([5e-5, -3e-4, 2e-4, 1e-3], dtype=torch.float64)  # inside and outside the clip
        ratio = torch.exp(lp - old)
        policy = torch.mean(torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip)))
        kl = 0.5 * torch.mean((lp - old) ** 2)
        old_table = torch.zeros(b, 2, dtype=torch.float64)
        old_table[:, k] = old
        loss, metrics = step_loss(
            _Engine(model),
            algorithm=algorithm,
            ctx=ctx,
            traj=traj,
            k=k,
            idx=torch.arange(b),
            cond=_COND,
            advantages=advantages,
            old_log_probs=old_table,
            normalizer=normalizer,
        )
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, (policy + kl_coeff * kl) / normalizer, atol=F64, rtol=0)
        torch.testing.assert_close(metrics["kl_loss"], kl, atol=F64, rtol=0)
        torch.testing.assert_close(metrics["policy_loss"], policy, atol=F64, rtol=0)
        assert 0 < metrics["clipfrac"].item() < 1


def test_advantages_are_the_references():
    """use_group with one reward (reward_aggr and advantage_aggr agree there): per prompt group (r - mean) /
    (torch.std, unbiased, + 1e-8), clamped to +-adv_clip_max in the loss."""
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.5, 0.0, 0.0, 0.0, 9.0, 4.0, 4.0, 4.0, 4.0], dtype=torch.float64)
    groups = torch.arange(3).repeat_interleave(4)
    expected = []
    for grp in rewards.split(4):
        expected.append(((grp - grp.mean()) / (grp.std() + 1e-8)).clamp(-1.2, 1.2))
    got = MixGRPO(_mix_config(adv_clip_max=1.2)).advantages(rewards, groups)
    torch.testing.assert_close(got, torch.cat(expected), atol=F64, rtol=0)
    assert got[8:].abs().max().item() == 0.0 and got.abs().max().item() == 1.2


# -------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"sde_type": "cps"}, r"flowgrpo\.sde_type='cps'.*Flow-GRPO's SDE step"),
        ({"mix.strategy": "linear"}, r"flowgrpo\.mix.strategy='linear'.*progressive"),
        ({"mix.window_size": 0}, r"flowgrpo\.mix\.window_size=0 is invalid: at least 1"),
        (
            {"mix.strategy": "random", "num_steps": 5},
            r"flowgrpo\.mix.window_size=4.*at most num_steps - 2 = 3",
        ),
        ({"mix.tail_solver": "unipc"}, r"flowgrpo\.mix.tail_solver='unipc'.*dpmsolver\+\+"),
        ({"mix.tail_compress_ratio": 0.0}, r"flowgrpo\.mix\.tail_compress_ratio=0\.0 is invalid: in \(0, 1\]"),
        ({"mix.dpm_solver_type": "euler"}, r"flowgrpo\.mix.dpm_solver_type='euler'.*midpoint"),
        ({"kl_coef": 0.1}, r"flowgrpo\.kl_coef=0\.1.*flowgrpo\.mix.kl_coef.*fix: flowgrpo\.kl_coef=0"),
        ({"shift": 0.0}, r"flowgrpo\.shift=0\.0.*fix: flowgrpo\.shift=3"),
        (
            {"schedule": "pipeline", "mix.tail_solver": "dpmsolver++"},
            r"flowgrpo\.schedule='pipeline'.*fix: flowgrpo\.schedule=auto.*mix.tail_solver=euler",
        ),
        ({"mix.strategy": "decay", "mix.min_iters_per_group": 20}, r"mix.min_iters_per_group=20.*<= mix.max"),
        ({"num_steps": 2}, r"flowgrpo\.num_steps=2.*at least 3"),
    ],
)
def test_bad_mix_keys_are_named(keys, words):
    from sp_diffusers.flowgrpo.build import check_algorithm

    c = _mix_config(**keys)
    with pytest.raises(ConfigError, match=words):
        check_algorithm(c)
