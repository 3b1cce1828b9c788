"""Flow-GRPO (arXiv 2505.05470) and DanceGRPO (arXiv 2505.07818) for diffusers transformers under sequence
parallelism.

Flow-GRPO turns a flow-matching ODE sampler into an SDE inside a short window of steps so each of those
steps is a Gaussian policy with a log-probability, then trains with a group-relative, PPO-clipped
objective, following the flow_grpo / verl-omni reference implementations; DanceGRPO makes every step an SDE step
and trains a random subset of them per sample (``flowgrpo.algorithm``). The math modules (schedule, sde, steps,
advantages, selection, loss) import nothing but torch (``pipeline_schedule`` builds diffusers' schedulers);
rollout, update, trainer and friends run it on an ``FSDPEngine``. The math exported here:

- :func:`pipeline_schedule` / :func:`linspace_schedule` (-> :class:`Schedule`): a family's schedule as its
  pipeline builds it, or DanceGRPO's; :func:`flow_sigmas`, :func:`qwenimage_mu`, :func:`timesteps_from_sigmas`;
- :func:`sde_step_with_logprob` (-> :class:`SDEStep`), :func:`cps_step_with_logprob`,
  :func:`dance_step_with_logprob` (picked by :class:`StepRule`) and :func:`ode_step`: one denoising step;
- :func:`group_advantages`: per-prompt-group normalised rewards; :func:`kept_samples`: the zero-advantage filter;
- :func:`flowgrpo_loss`: the clipped policy-gradient (+ optional KL) loss of one trained step and its metrics.
"""

from __future__ import annotations

from .algorithms.advantages import group_advantages
from .algorithms.loss import flowgrpo_loss
from .algorithms.selection import kept_samples
from .sampling.pipeline_schedule import Schedule, linspace_schedule, pipeline_schedule
from .sampling.schedule import flow_sigmas, qwenimage_mu, timesteps_from_sigmas
from .sampling.sde import (
    SDEStep,
    StepRule,
    cps_step_with_logprob,
    dance_step_with_logprob,
    ode_step,
    sde_step_with_logprob,
)

__all__ = [
    "SDEStep",
    "Schedule",
    "StepRule",
    "cps_step_with_logprob",
    "dance_step_with_logprob",
    "flow_sigmas",
    "flowgrpo_loss",
    "group_advantages",
    "kept_samples",
    "linspace_schedule",
    "ode_step",
    "pipeline_schedule",
    "qwenimage_mu",
    "sde_step_with_logprob",
    "timesteps_from_sigmas",
]
