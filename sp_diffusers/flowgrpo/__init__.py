"""Flow-GRPO (arXiv 2505.05470) for diffusers transformers under sequence parallelism.

Flow-GRPO turns a flow-matching ODE sampler into an SDE inside a short window of steps so each of those
steps is a Gaussian policy with a log-probability, then trains with a group-relative, PPO-clipped
objective, following the verl-omni / flow_grpo reference implementations. The math modules (schedule,
sde, advantages, loss) import nothing but torch; rollout, update, trainer and friends run it on an
``FSDPEngine``. The math exported here:

- :func:`flow_sigmas`, :func:`qwenimage_mu`, :func:`timesteps_from_sigmas`: the sampler's schedule;
- :func:`sde_step_with_logprob` (-> :class:`SDEStep`) and :func:`ode_step`: one denoising step;
- :func:`group_advantages`: per-prompt-group normalised rewards;
- :func:`flowgrpo_loss`: the clipped policy-gradient (+ optional KL) loss of one window step and its metrics.
"""

from __future__ import annotations

from .advantages import group_advantages
from .loss import flowgrpo_loss
from .schedule import flow_sigmas, qwenimage_mu, timesteps_from_sigmas
from .sde import SDEStep, ode_step, sde_step_with_logprob

__all__ = [
    "SDEStep",
    "flow_sigmas",
    "flowgrpo_loss",
    "group_advantages",
    "ode_step",
    "qwenimage_mu",
    "sde_step_with_logprob",
    "timesteps_from_sigmas",
]
