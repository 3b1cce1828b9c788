"""MixGRPO against its reference code (Tencent-Hunyuan/MixGRPO), re-implemented here from the reference's formulas and
control flow, independently of sp_diffusers' code: the window schedule (``grpo_states.GRPOTrainingStates``), the
DPM-Solver++ tail (``sampling_utils.run_sample_step`` with ``dpm_apply_strategy="post"``), the rollout around the
window, the loss (``train_grpo_flux.train_one_step``) and the advantages. One process, CPU.

Tolerances:
- the window schedule is integers: compared exactly, at every iteration of several full cycles;
- the tail's sigmas are float32 computed by the same float32 operations as the reference: compared exactly
  (``torch.equal``), and against float64 math at 1e-6 (a few float32 ulps of numbers <= 1);
- one DPM-Solver++ step, the loss and the advantages run in float64 on O(1) values: they agree with the reference's
  formulas (and diffusers' ``DPMSolverMultistepScheduler``) to float64 rounding, ~1e-15 relative; 1e-10 still
  catches any formula error (a wrong coefficient moves the result by >= 1e-3);
- the whole rollout runs in float32 (the rollout's dtype), the reference re-implementation too, from the same model,
  noise and SDE draws: they differ only by how the DPM coefficients are rounded (ours: float64 math rounded once to
  float32; the reference's: float32 tensor ops), <= ~1e-6 relative per coefficient, on latents of size <= ~5 over
  <= 12 steps whose coefficients are <= ~2 in size and a model with Lipschitz constant <= 1: 2e-5 absolute bounds
  that (measured: <= 7.2e-7 on the final latent; the window's latents and log-probs agree bit for bit), while a
  wrong tail moves the final latent by far more (measured: heun for midpoint >= 6e-3, Euler for DPM >= 3.9e-2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.base import StepContext
from sp_diffusers.flowgrpo.algorithms.mix_grpo import MixGRPO, MixWindows
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
from sp_diffusers.flowgrpo.sampling.dpm import compressed_tail, dpm_solver_pp_step
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule
from sp_diffusers.flowgrpo.sampling.rollout import Trajectory, rollout
from sp_diffusers.flowgrpo.sampling.sde import StepRule

F64 = 1e-10
ROLLOUT_TOL = 2e-5  # float32 rollouts (module docstring)


def _mix_config(**keys) -> TrainConfig:
    c = TrainConfig()
    c.flowgrpo.algorithm, c.flowgrpo.shift = "mix_grpo", 3.0
    for k, v in keys.items():
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
    c = _mix_config(
        num_steps=n, mix_window_size=size, mix_strategy=strategy, mix_iters_per_group=ipg,
        mix_prog_overlap=overlap, mix_prog_overlap_step=step, mix_roll_back=roll_back,
    )  # fmt: skip
    g = c.flowgrpo
    MixGRPO.check(c)
    ref = _ReferenceStates(
        ipg, size, n - 2, strategy, overlap, step, g.mix_max_iters_per_group, g.mix_min_iters_per_group,
        roll_back, g.mix_exp_decay_threshold, g.mix_exp_decay_k,
    )  # fmt: skip
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
    c = _mix_config(num_steps=10, mix_window_size=3, mix_iters_per_group=2, mix_prog_overlap=True, mix_roll_back=True)
    w = MixWindows(c.flowgrpo)
    got = [w.window(i, torch.Generator())[:2] for i in range(20)]
    # max = 8: starts 0, 0, 1, 1, ..., 5, 5 (full windows), 6, 6 (steps 6, 7), 7, 7 (step 7), 8, 8 (none), 0, 0
    assert got[:2] == [(0, 3), (0, 3)] and got[10:12] == [(5, 8), (5, 8)]
    assert got[12:18] == [(6, 8), (6, 8), (7, 8), (7, 8), (8, 8), (8, 8)]
    assert got[18:] == [(0, 3), (0, 3)]
    fresh = MixWindows(c.flowgrpo)
    assert fresh.window(17, torch.Generator())[:2] == (8, 8) and fresh.window(3, torch.Generator())[:2] == (1, 4)


def test_random_windows_are_uniform_and_shared():
    c = _mix_config(num_steps=25, mix_strategy="random")
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
    noise; with mix_same_noise the samples of a prompt share their first sample's noise."""
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = _mix_config(num_steps=12, mix_strategy="random", mix_same_noise=True)
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
        assert (a["window_start"], a["window_size"]) == (b["window_start"], b["window_size"])
        assert not torch.equal(a["latents"], b["latents"])
        for first in range(0, 8, 4):  # group_size 4: one noise per group, another for the next group
            assert all(torch.equal(a["latents"][first], a["latents"][first + j]) for j in range(4))
        assert not torch.equal(a["latents"][0], a["latents"][4])
    assert len({b["window_start"] for b in batches[0]}) > 1  # it moves between iterations


# ------------------------------------------------------------------------------------------------- the tail


def _shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


@pytest.mark.parametrize(
    ("n", "last", "ratio", "points"),
    # (N - L) * r: 22 * 0.4 = 8.8 -> 8; 15 * 0.4 = 6.000000000000001 -> 6; 5 * 0.4 = 2.0 -> 2; 3 * 0.4 = 1.2 ->
    # the reference's 1 point (no step: its sample stays at sigma_{L+1}), ours 2 (the step to 0)
    [(25, 3, 0.4, 8), (25, 10, 0.4, 6), (25, 20, 0.4, 2), (25, 22, 0.4, 2), (25, 3, 0.2, 4), (10, 1, 1.0, 9)],
)
def test_compressed_tail_is_the_references(n, last, ratio, points):
    shift = 3.0
    tail = compressed_tail(n, shift, last, ratio)
    assert tail.sigmas.numel() == points == max(int(max((n - last) * ratio, 1)), 2)
    # the reference's float32 ops: shift(linspace(t_{L+1}, 0, P)), t = linspace(1, 0, N + 1)
    t_start = torch.linspace(1, 0, n + 1)[last + 1].item()
    assert torch.equal(tail.sigmas, _shift(shift, torch.linspace(t_start, 0, points)))
    exact = [_shift(shift, (1 - (last + 1) / n) * (1 - j / (points - 1))) for j in range(points)]
    torch.testing.assert_close(tail.sigmas.double(), torch.tensor(exact, dtype=torch.float64), atol=1e-6, rtol=0)
    # it starts where the schedule is after the window, bit for bit, and ends at 0
    assert tail.sigmas[0].item() == linspace_schedule(n, shift).sigmas[last + 1].item() and tail.sigmas[-1] == 0
    assert tail.timesteps.tolist() == [float(int(s * 1000)) for s in tail.sigmas[:-1]]  # int(sigma * 1000)


def _diffusers_step(solver_type, sigmas, index, m_list, x):
    """diffusers' DPMSolverMultistepScheduler (dpmsolver++, flow sigmas) one update at step ``index`` of
    ``sigmas`` (float64): the form MixGRPO's dpm_step takes (first order with one output, second with two)."""
    from diffusers import DPMSolverMultistepScheduler

    s = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++", solver_type=solver_type, use_flow_sigmas=True,
        prediction_type="flow_prediction", solver_order=2,
    )  # fmt: skip
    s.sigmas = sigmas
    s._step_index = index
    if len(m_list) == 1:
        return s.dpm_solver_first_order_update(m_list[0], sample=x)
    return s.multistep_dpm_solver_second_order_update(m_list, sample=x)


def _reference_dpm_pp(solver_type, sigmas, i, m0, m1, x):
    """sampling_utils' ODE updates (dpmsolver++), with tensors, as the reference writes them."""
    alpha = lambda s: 1 - s  # noqa: E731
    lam = lambda s: torch.log(alpha(s)) - torch.log(s)  # noqa: E731
    s_t, s0 = sigmas[i + 1], sigmas[i]
    h = lam(s_t) - lam(s0)
    if m1 is None:
        return (s_t / s0) * x - (alpha(s_t) * (torch.exp(-h) - 1.0)) * m0
    r0 = (lam(s0) - lam(sigmas[i - 1])) / h
    d0, d1 = m0, (1.0 / r0) * (m0 - m1)
    out = (s_t / s0) * x - (alpha(s_t) * (torch.exp(-h) - 1.0)) * d0
    if solver_type == "midpoint":
        return out - 0.5 * (alpha(s_t) * (torch.exp(-h) - 1.0)) * d1
    return out + (alpha(s_t) * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1


@pytest.mark.parametrize("solver_type", ["midpoint", "heun"])
def test_dpm_step_is_the_references_and_diffusers(solver_type):
    g = torch.Generator().manual_seed(0)
    x, m0, m1 = (torch.randn(3, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sigmas = torch.tensor([0.95, 0.8, 0.55, 0.3, 0.0], dtype=torch.float64)
    for i in (1, 2):
        s_prev, s, s_next = (sigmas[i - 1].item(), sigmas[i].item(), sigmas[i + 1].item())
        ours = dpm_solver_pp_step(x, m0, s, s_next, (m1, s_prev), solver_type)
        torch.testing.assert_close(ours, _reference_dpm_pp(solver_type, sigmas, i, m0, m1, x), atol=F64, rtol=0)
        torch.testing.assert_close(ours, _diffusers_step(solver_type, sigmas, i, [m1, m0], x), atol=F64, rtol=0)
        first = dpm_solver_pp_step(x, m0, s, s_next, None, solver_type)
        torch.testing.assert_close(first, _reference_dpm_pp(solver_type, sigmas, i, m0, None, x), atol=F64, rtol=0)
        torch.testing.assert_close(first, _diffusers_step(solver_type, sigmas, i, [m0], x), atol=F64, rtol=0)
        assert (ours - first).abs().max() > 1e-3  # the second-order term is there
    # the last step (to 0) is first order and lands on the data prediction, as the reference's lower_order_final
    assert torch.equal(dpm_solver_pp_step(x, m0, 0.3, 0.0, (m1, 0.55), solver_type), m0)
    # from sigma_prev = 1 (a window of one step at step 0): lambda = -inf, D1 = 0 in the reference: first order
    at_one = torch.tensor([1.0, 0.8, 0.5], dtype=torch.float64)
    torch.testing.assert_close(
        dpm_solver_pp_step(x, m0, 0.8, 0.5, (m1, 1.0), solver_type),
        _reference_dpm_pp(solver_type, at_one, 1, m0, m1, x), atol=F64, rtol=0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- the rollout


class _Model(torch.nn.Module):
    """A velocity of Lipschitz constant <= 1 in x that depends on the timestep, counting its calls."""

    def __init__(self, dim: int, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        w = torch.randn(dim, dim, generator=g, dtype=torch.float64)
        self.w = torch.nn.Parameter((w / torch.linalg.matrix_norm(w, ord=2)).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(dim, generator=g, dtype=torch.float64).to(dtype))
        self.calls = 0

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        t = timestep.reshape(-1, *([1] * (hidden_states.ndim - 1))) / 1000.0
        return torch.tanh(hidden_states @ self.w) - t * self.b


class _Engine:
    def __init__(self, model: _Model) -> None:
        self.model = model

    def forward(self, **inputs) -> torch.Tensor:
        return self.model(**inputs)


class _Adapter:
    def inputs(self, latents, timestep, embeds, mask, pooled=None):
        return {"hidden_states": latents, "timestep": timestep.expand(latents.shape[0])}


_COND = {"prompt_embeds": torch.zeros(2, 1, 1), "prompt_embeds_mask": torch.ones(2, 1, dtype=torch.bool)}


def _reference_rollout(model, noise, n, shift, start, size, eta, tail, ratio, solver_type, seed):
    """run_sample_step (flow_grpo_sampling; dpm_algorithm_type null, or dpmsolver++ with the post strategy) in
    float32, as the reference writes it: one schedule whose steps after the window's last are the compressed tail."""
    sigmas = _shift(shift, torch.linspace(1, 0, n + 1))
    last = start + size - 1
    if tail:
        points = int(max((n - last) * ratio, 1))
        post = _shift(shift, torch.linspace(torch.linspace(1, 0, n + 1)[last + 1].item(), 0, points))
        sigmas = torch.cat([sigmas[: last + 1], post])
    gen = torch.Generator().manual_seed(seed)
    z, outputs, lower, stored, log_probs = noise.clone(), [None, None], 0, [], []
    for i in range(sigmas.numel() - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        pred = model(z, torch.full((z.shape[0],), float(int(sigma * 1000))))
        x0 = z - sigma * pred
        if not tail or i <= last:
            outputs = [outputs[1], x0]  # dpm_state.update before flow_grpo_step
            dt = sigma_next - sigma
            if start <= i <= last:  # flow_grpo_step, the SDE
                stored.append(z)
                std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma))) * eta
                mean = z * (1 + std**2 / (2 * sigma) * dt) + pred * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
                z = mean + std * torch.sqrt(-dt) * torch.randn(z.shape, generator=gen)
                scale = std * torch.sqrt(-dt)
                lp = -((z - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
                log_probs.append(lp.mean(dim=tuple(range(1, lp.ndim))))
                if i == last:
                    stored.append(z)
            else:  # determistic: Euler
                z = z + dt * pred
            lower = min(lower + 1, 2)
            continue
        outputs = [outputs[1], x0]
        if lower < 1 or i == sigmas.numel() - 2:  # lower_order_final
            z = _reference_dpm_pp(solver_type, sigmas, i, x0, None, z)
        else:
            z = _reference_dpm_pp(solver_type, sigmas, i, outputs[1], outputs[0], z)
        lower = min(lower + 1, 2)
    return z, torch.stack(stored, 1), torch.stack(log_probs, 1), sigmas.numel() - 1


@pytest.mark.parametrize(
    ("n", "start", "size", "ratio", "solver"),
    [
        (10, 2, 2, 0.4, "euler"),
        (12, 2, 2, 0.7, "midpoint"),  # L = 3: 9 * 0.7 = 6.3 -> 6 points, 5 tail steps (4 second order)
        (12, 2, 2, 0.7, "heun"),
        (12, 0, 1, 0.5, "midpoint"),  # L = 0: the history at sigma = 1, a first-order first tail step
        (12, 3, 4, 0.4, "midpoint"),  # L = 6: 6 * 0.4 = 2.4 -> 2 points, one step to 0
        (25, 0, 4, 0.4, "midpoint"),  # the released scripts' 25 steps and ratio, the first window
    ],
)
def test_rollout_with_the_tail_is_the_references(n, start, size, ratio, solver):
    shift, eta, seed = 3.0, 0.7, 5
    model = _Model(4)
    noise = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(9))
    tail = None
    if solver != "euler":
        tail = compressed_tail(n, shift, start + size - 1, ratio, solver)
    schedule = linspace_schedule(n, shift)
    with torch.no_grad():
        traj = rollout(
            _Engine(model), _Adapter(), _COND, noise, schedule, start, size, StepRule("sde", eta),
            torch.Generator().manual_seed(seed), tail=tail,
        )  # fmt: skip
        calls = model.calls
        final, latents, log_probs, steps = _reference_rollout(
            model, noise, n, shift, start, size, eta, tail is not None, ratio, solver, seed
        )
    assert calls == steps  # with a tail, start + size + (P - 1) model calls: fewer than N where it compresses
    if tail is not None:
        assert calls == start + size + tail.num_steps <= n
    torch.testing.assert_close(traj.latents, latents, atol=ROLLOUT_TOL, rtol=0)
    torch.testing.assert_close(traj.log_probs, log_probs, atol=ROLLOUT_TOL, rtol=0)
    torch.testing.assert_close(traj.final, final, atol=ROLLOUT_TOL, rtol=0)
    assert traj.window_start == start and traj.latents.shape[1] == size + 1


def test_an_empty_window_stores_one_latent_and_no_log_prob():
    schedule = linspace_schedule(8, 3.0)
    noise = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        traj = rollout(
            _Engine(_Model(4)), _Adapter(), _COND, noise, schedule, 6, 0, StepRule("sde", 0.7), torch.Generator()
        )
        euler = noise.clone()
        model = _Model(4)
        for i in range(8):
            s, s_next = schedule.sigmas[i].item(), schedule.sigmas[i + 1].item()
            if i == 6:
                at_start = euler.clone()
            euler = euler + (s_next - s) * model(euler, schedule.timesteps[i].expand(2))
    assert traj.latents.shape == (2, 1, 6, 4) and traj.log_probs.shape == (2, 0) and traj.steps().shape == (2, 0)
    torch.testing.assert_close(traj.latents[:, 0], at_start, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.final, euler, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------ the loss, advantages


def test_loss_is_the_references():
    """MixGRPO.step_loss in float64 against train_one_step's arithmetic: the ratio of flow_grpo_step's log-prob of
    the stored next latent to the rollout's, the clipped policy loss of the clamped advantages, plus kl_coeff *
    0.5 mean((lp - lp_old)^2), each divided by grad-accumulation x trained steps."""
    n, shift, eta, clip, kl_coeff, normalizer = 10, 3.0, 0.7, 1e-4, 0.3, 6.0
    c = _mix_config(num_steps=n, noise_level=eta, clip_range=clip, mix_kl_coef=kl_coeff)
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
        lp = (-((nxt - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))).mean((1, 2))
        old = lp - torch.tensor([5e-5, -3e-4, 2e-4, 1e-3], dtype=torch.float64)  # inside and outside the clip
        ratio = torch.exp(lp - old)
        policy = torch.mean(torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip)))
        kl = 0.5 * torch.mean((lp - old) ** 2)
        old_table = torch.zeros(b, 2, dtype=torch.float64)
        old_table[:, k] = old
        loss, metrics = algorithm.step_loss(
            _Engine(model), None, ctx=ctx, traj=traj, k=k, idx=torch.arange(b), cond=_COND,
            advantages=advantages, old_log_probs=old_table, normalizer=normalizer,
        )  # fmt: skip
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
        ({"mix_strategy": "linear"}, r"flowgrpo\.mix_strategy='linear'.*progressive"),
        ({"mix_window_size": 0}, r"flowgrpo\.mix_window_size=0: at least 1"),
        ({"mix_strategy": "random", "num_steps": 5}, r"flowgrpo\.mix_window_size=4.*at most num_steps - 2 = 3"),
        ({"mix_tail_solver": "unipc"}, r"flowgrpo\.mix_tail_solver='unipc'.*dpmsolver\+\+"),
        ({"mix_tail_compress_ratio": 0.0}, r"flowgrpo\.mix_tail_compress_ratio=0\.0: in \(0, 1\]"),
        ({"mix_dpm_solver_type": "euler"}, r"flowgrpo\.mix_dpm_solver_type='euler'.*midpoint"),
        ({"kl_coef": 0.1}, r"flowgrpo\.kl_coef=0\.1.*flowgrpo\.mix_kl_coef.*fix: flowgrpo\.kl_coef=0"),
        ({"shift": 0.0}, r"flowgrpo\.shift=0\.0.*fix: flowgrpo\.shift=3"),
        (
            {"schedule": "pipeline", "mix_tail_solver": "dpmsolver++"},
            r"flowgrpo\.schedule='pipeline'.*fix: flowgrpo\.schedule=auto.*mix_tail_solver=euler",
        ),
        ({"mix_strategy": "decay", "mix_min_iters_per_group": 20}, r"mix_min_iters_per_group=20.*<= mix_max"),
        ({"num_steps": 2}, r"flowgrpo\.num_steps=2.*at least 3"),
    ],
)
def test_bad_mix_keys_are_named(keys, words):
    from sp_diffusers.flowgrpo.build import check_algorithm

    c = _mix_config(**keys)
    with pytest.raises(ConfigError, match=words):
        check_algorithm(c)


def test_the_rollout_with_a_tail_reads_no_tensor_back():
    """The hot path: the window, the Euler steps and the DPM tail read no device tensor on the host (the schedule's
    and the tail's numbers come from their CPU copies). On the ``meta`` device every such read raises, as a host
    sync would cost on an accelerator."""
    n = 12
    model = _Model(4).to("meta")
    noise = torch.randn(2, 6, 4).to("meta")
    tail = compressed_tail(n, 3.0, 3, 0.7)
    with torch.no_grad():
        traj = rollout(
            _Engine(model), _Adapter(), _COND, noise, linspace_schedule(n, 3.0), 2, 2, StepRule("sde", 0.7),
            torch.Generator().manual_seed(0), tail=tail,
        )  # fmt: skip
    assert traj.final.device.type == "meta" and traj.latents.shape == (2, 3, 6, 4) and traj.log_probs.shape == (2, 2)
    assert model.calls == 4 + tail.num_steps
