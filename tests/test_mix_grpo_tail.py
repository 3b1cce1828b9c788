"""MixGRPO's DPM-Solver++ tail and the rollout around its window against the reference code (Tencent-Hunyuan/MixGRPO,
``sampling_utils.run_sample_step`` with ``dpm_apply_strategy="post"``, its solver steps, and diffusers'
``DPMSolverMultistepScheduler``), re-implemented here independently of sp_diffusers' code. One process, CPU.

Tolerances:
- the tail's sigmas are float32 computed by the same float32 operations as the reference: compared exactly
  (``torch.equal``), and against float64 math at 1e-6 (a few float32 ulps of numbers <= 1);
- one DPM-Solver++ step runs in float64 on O(1) values: it agrees with the reference's formulas and diffusers' to
  float64 rounding, ~1e-15 relative; 1e-10 still catches any formula error (a wrong coefficient moves the result by
  >= 1e-3);
- the whole rollout runs in float32 (the rollout's dtype), the reference re-implementation too, from the same model,
  noise and SDE draws: they differ only by how the DPM coefficients are rounded (ours: float64 math rounded once to
  float32; the reference's: float32 tensor ops), <= ~1e-6 relative per coefficient, on latents of size <= ~5 over
  <= 12 steps whose coefficients are <= ~2 in size and a model with Lipschitz constant <= 1: 2e-5 absolute bounds
  that (measured: <= 7.2e-7 on the final latent; the window's latents and log-probs agree bit for bit), while a
  wrong tail moves the final latent by far more (measured: heun for midpoint >= 6e-3, Euler for DPM >= 3.9e-2).
"""

from __future__ import annotations

import math

import pytest
import torch

from sp_diffusers.flowgrpo.models.base import FamilyAdapter
from sp_diffusers.flowgrpo.sampling.denoise import Sampler, Span, denoise
from sp_diffusers.flowgrpo.sampling.dpm import compressed_tail, dpm_solver_pp_step
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule
from sp_diffusers.flowgrpo.sampling.sde import StepRule

F64 = 1e-10
ROLLOUT_TOL = 2e-5  # float32 rollouts (module docstring)


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
        algorithm_type="dpmsolver++",
        solver_type=solver_type,
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        solver_order=2,
    )
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
        torch.testing.assert_close(
            ours, _reference_dpm_pp(solver_type, sigmas, i, m0, m1, x), atol=F64, rtol=0
        )
        torch.testing.assert_close(
            ours, _diffusers_step(solver_type, sigmas, i, [m1, m0], x), atol=F64, rtol=0
        )
        first = dpm_solver_pp_step(x, m0, s, s_next, None, solver_type)
        torch.testing.assert_close(
            first, _reference_dpm_pp(solver_type, sigmas, i, m0, None, x), atol=F64, rtol=0
        )
        torch.testing.assert_close(first, _diffusers_step(solver_type, sigmas, i, [m0], x), atol=F64, rtol=0)
        assert (ours - first).abs().max() > 1e-3  # the second-order term is there
    # the last step (to 0) is first order and lands on the data prediction, as the reference's lower_order_final
    assert torch.equal(dpm_solver_pp_step(x, m0, 0.3, 0.0, (m1, 0.55), solver_type), m0)
    # from sigma_prev = 1 (a window of one step at step 0): lambda = -inf, D1 = 0 in the reference: first order
    at_one = torch.tensor([1.0, 0.8, 0.5], dtype=torch.float64)
    torch.testing.assert_close(
        dpm_solver_pp_step(x, m0, 0.8, 0.5, (m1, 1.0), solver_type),
        _reference_dpm_pp(solver_type, at_one, 1, m0, m1, x),
        atol=F64,
        rtol=0,
    )


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
    num_experts = 1

    def __init__(self, model: _Model) -> None:
        self.model = model

    def for_step(self, step: int) -> _Engine:
        return self

    def forward(self, **inputs) -> torch.Tensor:
        return self.model(**inputs)


class _Adapter(FamilyAdapter):
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
                mean = (
                    z * (1 + std**2 / (2 * sigma) * dt) + pred * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
                )
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
        traj = denoise(
            Sampler(_Engine(model), _Adapter(), schedule),
            _COND,
            noise,
            Span(start, size, StepRule("sde", eta), tail=tail),
            torch.Generator().manual_seed(seed)
        )
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
        traj = denoise(
            Sampler(_Engine(_Model(4)), _Adapter(), schedule),
            _COND,
            noise,
            Span(6, 0, StepRule("sde", 0.7)),
            torch.Generator()
        )
        euler = noise.clone()
        model = _Model(4)
        for i in range(8):
            s, s_next = schedule.sigmas[i].item(), schedule.sigmas[i + 1].item()
            if i == 6:
                at_start = euler.clone()
            euler = euler + (s_next - s) * model(euler, schedule.timesteps[i].expand(2))
    assert (
        traj.latents.shape == (2, 1, 6, 4) and traj.log_probs.shape == (2, 0) and traj.steps().shape == (2, 0)
    )
    torch.testing.assert_close(traj.latents[:, 0], at_start, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.final, euler, atol=1e-6, rtol=0)


def test_the_rollout_with_a_tail_reads_no_tensor_back():
    """The hot path: the window, the Euler steps and the DPM tail read no device tensor on the host (the schedule's
    and the tail's numbers come from their CPU copies). On the ``meta`` device every such read raises, as a host
    sync would cost on an accelerator."""
    n = 12
    model = _Model(4).to("meta")
    noise = torch.randn(2, 6, 4).to("meta")
    tail = compressed_tail(n, 3.0, 3, 0.7)
    with torch.no_grad():
        traj = denoise(
            Sampler(_Engine(model), _Adapter(), linspace_schedule(n, 3.0)),
            _COND,
            noise,
            Span(2, 2, StepRule("sde", 0.7), tail=tail),
            torch.Generator().manual_seed(0)
        )
    assert (
        traj.final.device.type == "meta"
        and traj.latents.shape == (2, 3, 6, 4)
        and traj.log_probs.shape == (2, 2)
    )
    assert model.calls == 4 + tail.num_steps
