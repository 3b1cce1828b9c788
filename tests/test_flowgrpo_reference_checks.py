"""Three differences from the reference trainers, each held here (one process, float64 unless stated).

- The SDE noise of a bf16 rollout is drawn in float32, as flow_grpo draws it (it casts the model output to float32
  before ``randn_tensor(..., dtype=model_output.dtype)``), for every step type.
- ``sde_type: cps`` with ``kl_coef > 0`` and a window that reaches the last step (sigma' = 0, noise std 0) is
  refused by the config check: the KL there divides by 0.
- DanceGRPO's KL scale: ``flowgrpo.dance.kl`` chooses verl-omni's (the Gaussian KL of the two steps) or flow_grpo's
  scale (no dt factor).
"""

from __future__ import annotations

import math

import pytest
import torch

from sp_diffusers.flowgrpo.algorithms.base import StepInputs
from sp_diffusers.flowgrpo.algorithms.dance_grpo import DanceGRPO
from sp_diffusers.flowgrpo.algorithms.flow_grpo import FlowGRPO
from sp_diffusers.flowgrpo.algorithms.loss import flowgrpo_loss
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule
from sp_diffusers.flowgrpo.sampling.sde import StepRule


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_bf16_rollout_draws_float32_noise(sde_type):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 16, 8, generator=g).to(torch.bfloat16)
    sigmas = linspace_schedule(6, 3.0).sigmas
    rule = StepRule(sde_type, 0.5)
    step = rule.step(x, v, sigmas, 2, generator=torch.Generator().manual_seed(11))
    eps = torch.randn(x.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float32)
    # the same float32 arithmetic as the step: mean + scale * eps, bit for bit
    sigma, sigma_next = float(sigmas[2]), float(sigmas[3])
    if sde_type == "cps":
        scale = torch.tensor(sigma_next * math.sin(0.5 * math.pi / 2.0))
    elif sde_type == "dance":
        scale = 0.5 * torch.sqrt(-(torch.tensor(sigma_next) - torch.tensor(sigma)))
    else:
        sig, nxt = torch.tensor(sigma), torch.tensor(sigma_next)
        std_t = torch.sqrt(sig / (1.0 - torch.minimum(sig, sigmas[1]))) * 0.5
        scale = std_t * torch.sqrt(-(nxt - sig))
    assert step.prev_sample.dtype == torch.float32
    torch.testing.assert_close(step.prev_sample, step.prev_sample_mean + scale * eps, atol=1e-6, rtol=0)
    # a bf16 draw (the old behaviour) is a different noise: rounded to 8 mantissa bits
    eps16 = torch.randn(x.shape, generator=torch.Generator().manual_seed(11), dtype=torch.bfloat16).float()
    assert (step.prev_sample - (step.prev_sample_mean + scale * eps16)).abs().max() > 1e-3


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


def test_cps_kl_with_a_window_reaching_the_last_step_is_refused():
    from sp_diffusers.flowgrpo.build import check_algorithm

    # num_steps 8, window 2: a start of 6 covers steps 6 and 7 (the last: sigma' = 0)
    bad = _config(sde_type="cps", kl_coef=0.01, num_steps=8, window_size=2, window_range=[0, 7])
    with pytest.raises(ConfigError, match=r"sde_type=cps.*kl_coef=0\.01.*last step.*window_range=\[0, 6\]"):
        check_algorithm(bad)
    check_algorithm(_config(sde_type="cps", kl_coef=0.01, num_steps=8, window_size=2, window_range=[0, 6]))
    check_algorithm(_config(sde_type="cps", kl_coef=0.0, num_steps=8, window_size=2, window_range=[0, 7]))
    check_algorithm(_config(sde_type="sde", kl_coef=0.01, num_steps=8, window_size=2, window_range=[0, 7]))
    # why: CPS's std at sigma' = 0 is 0, and the KL divides by it (NaN where the means agree, as on-policy)
    g = torch.Generator().manual_seed(1)
    x, v = (
        torch.randn(2, 4, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 4, 3, generator=g, dtype=torch.float64),
    )
    step = StepRule("cps", 0.8).step(x, v, torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64), 1, generator=g)
    assert step.std_dev_t.abs().max() == 0.0
    _, m = flowgrpo_loss(
        step.log_prob,
        step.log_prob,
        torch.ones(2, dtype=torch.float64),
        clip_range=1e-3,
        kl_coef=0.01,
        prev_sample_mean=step.prev_sample_mean,
        ref_prev_sample_mean=step.prev_sample_mean,
        std_dev_t=step.std_dev_t,
    )
    assert math.isnan(m["kl"].item())


def test_dance_kl_scale_follows_the_chosen_reference():
    schedule = linspace_schedule(6, 3.0)
    steps = torch.tensor([0, 3])
    eta = 0.3
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 10, 4, generator=g, dtype=torch.float64)
    v, v_ref = torch.randn_like(x), torch.randn_like(x)
    rule = StepRule("dance", eta)
    sigmas = schedule.sigmas.double()
    step = rule.step(x, v, sigmas, steps, prev_sample=x)
    ref = rule.step(x, v_ref, sigmas, steps, prev_sample=x)
    verl = DanceGRPO(_config(algorithm="dance_grpo", dance=dict(kl="verl_omni")))
    flow = DanceGRPO(_config(algorithm="dance_grpo", dance=dict(kl="flow_grpo")))
    dt = (sigmas[steps] - sigmas[steps + 1]).double()
    # what the update's evaluation hands the loss: the step's std_dev_t and sqrt(sigma - sigma') (update.py)
    inputs = StepInputs(steps, std_dev_t=step.std_dev_t, sqrt_dt=dt.sqrt())
    torch.testing.assert_close(verl.kl_std(inputs), eta * dt.sqrt())
    torch.testing.assert_close(flow.kl_std(inputs), step.std_dev_t)
    # flow_grpo's sde and cps steps keep their own std_dev_t whatever dance.kl says
    sde = FlowGRPO(_config(dance=dict(kl="verl_omni")))
    assert sde.kl_std(inputs) is step.std_dev_t

    def kl(cfg):
        _, m = flowgrpo_loss(
            step.log_prob,
            step.log_prob,
            torch.zeros(2, dtype=torch.float64),
            clip_range=1e-3,
            kl_coef=1.0,
            prev_sample_mean=step.prev_sample_mean,
            ref_prev_sample_mean=ref.prev_sample_mean,
            std_dev_t=cfg.kl_std(inputs),
        )
        return m["kl"]

    # verl_omni: the exact KL between the policy's and the reference's step Gaussians (std eta sqrt(dt)),
    # averaged over elements, then over samples
    std = (eta * dt.sqrt()).reshape(2, 1, 1)
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(step.prev_sample_mean, std),
        torch.distributions.Normal(ref.prev_sample_mean, std),
    )
    torch.testing.assert_close(kl(verl), exact.mean(dim=(1, 2)).mean(), atol=1e-12, rtol=1e-12)
    # flow_grpo's scale: dt times that, per sample
    per_sample = exact.mean(dim=(1, 2)) * dt
    torch.testing.assert_close(kl(flow), per_sample.mean(), atol=1e-12, rtol=1e-12)


def test_dance_kl_values_are_checked():
    from sp_diffusers.flowgrpo.build import check_algorithm

    with pytest.raises(ConfigError, match=r"flowgrpo\.dance.kl='verl'.*verl_omni.*flow_grpo"):
        check_algorithm(_config(algorithm="dance_grpo", dance=dict(kl="verl")))  # a dance_grpo key, checked there
