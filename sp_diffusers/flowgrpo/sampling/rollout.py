"""Rollout with a span of stochastic steps, and the per-step log-prob evaluation the trainer shares with it.

Steps outside the span ``[start, start + S)`` are deterministic ODE steps; the S steps inside are SDE steps
(:class:`~sp_diffusers.flowgrpo.sampling.sde.StepRule`) whose log-probs make the policy. FlowGRPO's span is its window
(S = W, at a random start); DanceGRPO's is every step (S = N). Stored per sample: ``latents [B, S+1, ...]`` (the
span's inputs and outputs), ``log_probs [B, S]``, ``train_steps [B, T]`` (the schedule steps each sample trains
on: the whole window for FlowGRPO, a random subset per sample for DanceGRPO) and ``final`` (the reward input).

Every rank of an SP group calls this with the same batch and the same generator seed, so the noise, the span
and the latents are identical there; the transformer's Ulysses attention does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...devices import to_device
from .guidance import guided, paired
from .pipeline_schedule import Schedule
from .sde import SDEStep, StepRule, ode_step

__all__ = ["Trajectory", "evaluate_window_step", "rollout", "velocity"]


@dataclass
class Trajectory:
    latents: torch.Tensor  # [B, S+1, ...] float32: the span's inputs and outputs
    log_probs: torch.Tensor  # [B, S] the rollout's log-probs of the span's steps
    window_start: int  # index into the schedule of the span's first step
    final: torch.Tensor  # [B, ...] the denoised latents (reward input)
    train_steps: torch.Tensor | None = None  # [B, T] schedule steps to train on; None: every span step
    host_steps: list[int] | None = None  # the T trained steps when every sample shares them (two experts)

    def host_step(self, k: int) -> int | None:
        """The schedule step of the k-th trained step as a host int when every sample shares it, else None."""
        if self.train_steps is None:
            return self.window_start + k
        return self.host_steps[k] if self.host_steps is not None else None

    def steps(self) -> torch.Tensor:
        """``[B, T]`` long: the schedule step of each sample's k-th trained step."""
        if self.train_steps is not None:
            return self.train_steps.to(self.latents.device)
        b, s = self.latents.shape[0], self.latents.shape[1] - 1
        return (self.window_start + torch.arange(s, device=self.latents.device)).expand(b, s)

    def step_latents(self, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step indices ``[b]``, latents ``[b, ...]``, next latents ``[b, ...]``) of samples ``idx``' k-th
        trained step."""
        steps = self.steps()[idx, k]
        pos = steps - self.window_start
        return steps, self.latents[idx, pos], self.latents[idx, pos + 1]

    def rollout_log_probs(self) -> torch.Tensor:
        """``[B, T]``: the rollout's log-prob of each trained step (old log-probs without recomputation)."""
        pos = self.steps() - self.window_start
        return torch.gather(self.log_probs.to(pos.device), 1, pos)


def velocity(
    engine,
    adapter,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    cond: dict[str, Any],
    cfg_scale: float,
    step: int | None = None,
    cfg_batch: bool = True,
) -> torch.Tensor:
    """The model's velocity at ``latents`` and the model timestep ``timestep`` (0-d or ``[B]``, 0..1000 scale);
    with ``cfg_scale > 1`` classifier-free guidance, both branches in one forward of 2B samples (``cfg_batch``;
    ``guidance.py``) or in two. ``step``: the schedule step (a host int), which picks the expert of a two-expert
    model (``experts.ExpertEngines``, Wan2.2); a plain engine ignores it."""
    if step is not None and hasattr(engine, "for_step"):
        engine = engine.for_step(step)
    dtype = next(engine.model.parameters()).dtype
    x = latents.to(dtype)

    def forward(x: torch.Tensor, t: torch.Tensor, embeds: str, mask: str, pooled: str, text: dict) -> torch.Tensor:
        # an image-conditioned family joins its condition_* tensors to the input and returns the noisy tokens' part
        # of the output (models/conditioning.py)
        condition = {k: v for k, v in text.items() if k.startswith("condition_")}
        extra = {"condition": condition} if condition else {}
        out = engine.forward(**adapter.inputs(x, t, text[embeds].to(dtype), text[mask], text.get(pooled), **extra))
        return adapter.noisy_output(out) if condition else out

    names = ("prompt_embeds", "prompt_embeds_mask", "pooled_prompt_embeds")
    if cfg_scale > 1.0 and cfg_batch:
        both = cond.get("cfg_pair") or paired(cond)
        t = timestep if timestep.dim() == 0 else torch.cat([timestep, timestep])
        v, v_neg = forward(torch.cat([x, x]), t, *names, both).chunk(2)
        return guided(v, v_neg, cfg_scale).float()
    v = forward(x, timestep, *names, cond)
    if cfg_scale > 1.0:
        v = guided(v, forward(x, timestep, *(f"negative_{n}" for n in names), cond), cfg_scale)
    return v.float()


def evaluate_window_step(
    engine,
    adapter,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    schedule: Schedule,
    step_index: int | torch.Tensor,
    cond: dict[str, Any],
    rule: StepRule,
    cfg_scale: float,
    cfg_batch: bool = True,
) -> SDEStep:
    """Log-prob of the stored ``next_latents`` under the current policy at schedule step ``step_index`` (an int,
    or a ``[B]`` long tensor when each sample trains on its own step, as DanceGRPO's do)."""
    # per-sample steps: the caller passes the engine of their expert; indexed where the latents are (a per-sample
    # index never travels to the host)
    step = None if isinstance(step_index, torch.Tensor) else step_index
    timestep = schedule.on(latents.device).timesteps[to_device(step_index, latents.device)]
    v = velocity(engine, adapter, latents, timestep, cond, cfg_scale, step=step, cfg_batch=cfg_batch)
    return rule.step(latents, v, schedule.sigmas, step_index, prev_sample=next_latents)


@torch.no_grad()
def rollout(
    engine,
    adapter,
    cond: dict[str, Any],
    noise: torch.Tensor,
    schedule: Schedule,
    window_start: int,
    window_size: int,
    rule: StepRule,
    generator: torch.Generator,
    cfg_scale: float = 1.0,
    final_is_prediction: bool = False,
    cfg_batch: bool = True,
    hold: Callable[[Any], Any] | None = None,
) -> Trajectory:
    """Denoise ``noise`` from sigma 1 to 0; SDE steps in ``[window_start, window_start + window_size)``.

    ``final_is_prediction``: the reward reads the last step's predicted data ``x - sigma v`` instead of the
    sampled last latent (DanceGRPO decodes that; after a final ODE step to sigma 0 the two are the same).
    ``hold``: each step's engine passes through it (``guidance.WeightHolder``: weights gathered once)."""
    sigmas = schedule.sigmas  # the CPU copy: its numbers are read on the host
    num_steps = schedule.num_steps
    if not 0 <= window_start <= num_steps - window_size:
        raise ValueError(
            f"window_start={window_start} with window_size={window_size} does not fit {num_steps} steps; "
            f"fix: flowgrpo.window_range within [0, {num_steps - window_size + 1})"
        )
    x = noise.float()
    on_device = schedule.on(
        x.device
    ).timesteps  # each step's timestep indexed there, not copied from the host
    stored, log_probs = [], []
    final = None
    if cfg_scale > 1.0 and cfg_batch:
        cond = {**cond, "cfg_pair": paired(cond)}  # stacked once, read by every step
    for i in range(num_steps):
        step_engine = engine.for_step(i) if hasattr(engine, "for_step") else engine
        if hold is not None:
            step_engine = hold(step_engine)
        v = velocity(step_engine, adapter, x, on_device[i], cond, cfg_scale, cfg_batch=cfg_batch)
        if i == num_steps - 1 and final_is_prediction:
            final = x - float(sigmas[i]) * v
        if window_start <= i < window_start + window_size:
            stored.append(x)
            step = rule.step(x, v, sigmas, i, generator=generator)
            x = step.prev_sample
            log_probs.append(step.log_prob)
        else:
            x = ode_step(x, v, float(sigmas[i]), float(sigmas[i + 1]))
        if i == window_start + window_size - 1:
            stored.append(x)
    final = x if final is None else final
    if hasattr(adapter, "final_latents"):  # Wan2.2 TI2V: the first frame is the image's, as its pipeline ends
        final = adapter.final_latents(final, cond)
    return Trajectory(torch.stack(stored, dim=1), torch.stack(log_probs, dim=1), window_start, final)
