"""Rollout with a span of stochastic steps, and the per-step log-prob evaluation the trainer shares with it.

Steps outside the span ``[start, start + S)`` are deterministic ODE steps; the S steps inside are SDE steps
(:class:`~sp_diffusers.flowgrpo.sampling.sde.StepRule`) whose log-probs make the policy. FlowGRPO's span is its window
(S = W, at a random start); DanceGRPO's is every step (S = N). Stored per sample: ``latents [B, S+1, ...]`` (the
span's inputs and outputs), ``log_probs [B, S]``, ``train_steps [B, T]`` (the schedule steps each sample trains
on: the whole window for FlowGRPO, a random subset per sample for DanceGRPO) and ``final`` (the reward input);
on request the span's step means ``means [B, S, ...]`` too (GRPO-Guard's old policy).

Per-sample windows (``start`` a list, one start per sample, as verl-omni's ``sample_per_sample_sde_windows``): at a
step where some samples are in their window and others not, the SDE step and the ODE step are both computed for
the batch and each sample takes its own (``torch.where``: bit for bit each step alone), and each sample's window is
stored at its own positions ``[B, S+1, ...]`` (``Trajectory.starts``). Which samples are where is known on the host
from the starts; the tables that say so reach the device once per rollout, so no step waits on the device.

After the span, the steps are Euler ODE steps on the schedule, or (a ``dpm.DPMTail``: MixGRPO) DPM-Solver++ on a
compressed tail of the schedule.

Every rank of an SP group calls this with the same batch and the same generator seed, so the noise, the span
and the latents are identical there; the transformer's Ulysses attention does the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...parallel.devices import to_device
from .dpm import DPMTail, dpm_solver_pp_step
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
    starts: torch.Tensor | None = None  # [B] long: each sample's first span step (per-sample windows); None: window_start
    means: torch.Tensor | None = None  # [B, S, ...] the rollout's step means, when the rollout was asked to keep them
    old_means: torch.Tensor | None = None  # [B, T, ...] the old policy's step means at the trained steps (collect.py)
    extras: dict[str, Any] = field(default_factory=dict)  # what the algorithm's update reads beyond the span

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

    def _first(self, idx: torch.Tensor | None = None) -> torch.Tensor | int:
        """The span's first schedule step of samples ``idx`` (all: ``[B, 1]``), or the shared ``window_start``."""
        if self.starts is None:
            return self.window_start
        starts = self.starts.to(self.latents.device)
        return starts[:, None] if idx is None else starts[idx]

    def step_latents(self, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step indices ``[b]``, latents ``[b, ...]``, next latents ``[b, ...]``) of samples ``idx``' k-th
        trained step."""
        steps = self.steps()[idx, k]
        pos = steps - self._first(idx)
        return steps, self.latents[idx, pos], self.latents[idx, pos + 1]

    def rollout_log_probs(self) -> torch.Tensor:
        """``[B, T]``: the rollout's log-prob of each trained step (old log-probs without recomputation); zeros
        for a rollout without stochastic steps (an algorithm without a ratio reads none)."""
        pos = self.steps() - self._first()
        if self.log_probs.shape[1] == 0:
            return torch.zeros(pos.shape, device=pos.device)
        return torch.gather(self.log_probs.to(pos.device), 1, pos)

    def old_step_means(self, idx: torch.Tensor, k: int) -> torch.Tensor:
        """``[b, ...]``: the old policy's step mean at samples ``idx``' k-th trained step (``old_means``)."""
        if self.old_means is None:
            raise ValueError(
                "Trajectory.old_means is not set: the algorithm reads the old policy's step means, which collect.py "
                "stores when Algorithm.keeps_old_means() says so; fix: return True there"
            )
        return self.old_means[idx, k]

    def rollout_means(self) -> torch.Tensor:
        """``[B, T, ...]``: the rollout's step mean of each trained step (kept by ``rollout(keep_means=True)``)."""
        if self.means is None:
            raise ValueError("the rollout kept no step means; fix: rollout(..., keep_means=True)")
        pos = self.steps() - self._first()
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
        return self.means[rows, pos]


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
    window_start: int | Sequence[int],
    window_size: int,
    rule: StepRule,
    generator: torch.Generator,
    cfg_scale: float = 1.0,
    final_is_prediction: bool = False,
    cfg_batch: bool = True,
    hold: Callable[[Any], Any] | None = None,
    solver: Any = None,
    keep_means: bool = False,
    tail: DPMTail | None = None,
) -> Trajectory:
    """Denoise ``noise`` from sigma 1 to 0; SDE steps in ``[window_start, window_start + window_size)``.

    ``window_start``: one start for every sample, or a host sequence of one start per sample (module docstring).
    ``final_is_prediction``: the reward reads the last step's predicted data ``x - sigma v`` instead of the
    sampled last latent (DanceGRPO decodes that; after a final ODE step to sigma 0 the two are the same).
    ``hold``: each step's engine passes through it (``guidance.WeightHolder``: weights gathered once).
    ``solver``: the deterministic steps' solver (``step(x, v, sigmas, i) -> x'``, e.g. ``dpm_solver.DPMSolver2``);
    None: Euler. ``keep_means``: store the span's step means too (``Trajectory.means``). ``window_start`` a
    sequence: each sample its own window (per-sample windows; Euler outside them).
    ``tail``: the steps after the span run by DPM-Solver++ on the tail's own (compressed) sigmas instead of Euler on
    the schedule's (``dpm.py``: MixGRPO); its history is the span's last data prediction. A span of 0 steps stores
    the latent at ``window_start`` alone and no log-prob (an iteration that trains nothing)."""
    if not isinstance(window_start, int):
        if solver is not None or tail is not None:
            raise ValueError(
                "per-sample windows take the Euler step outside the windows; fix: solver=None, tail=None"
            )
        return _rollout_per_sample(
            engine,
            adapter,
            cond,
            noise,
            schedule,
            list(window_start),
            window_size,
            rule,
            generator,
            cfg_scale,
            final_is_prediction,
            cfg_batch,
            hold,
            keep_means,
        )
    sigmas = schedule.sigmas  # the CPU copy: its numbers are read on the host
    num_steps = schedule.num_steps
    if not 0 <= window_start <= num_steps - window_size or window_size < 0:
        raise ValueError(
            f"window_start={window_start} with window_size={window_size} does not fit {num_steps} steps; "
            f"fix: flowgrpo.window_range within [0, {num_steps - window_size + 1})"
        )
    end = window_start + window_size
    if tail is not None:
        _check_tail(tail, engine, sigmas, window_size, end, num_steps)
    stop = num_steps if tail is None else end  # the schedule's steps this loop runs; the tail runs the rest
    x = noise.float()
    on_device = schedule.on(
        x.device
    ).timesteps  # each step's timestep indexed there, not copied from the host
    stored, log_probs, means = [], [], []
    final = None
    last_prediction = None  # (x0, sigma) of the span's last step: the tail's history
    if cfg_scale > 1.0 and cfg_batch:
        cond = {**cond, "cfg_pair": paired(cond)}  # stacked once, read by every step
    for i in range(stop):
        step_engine = engine.for_step(i) if hasattr(engine, "for_step") else engine
        if hold is not None:
            step_engine = hold(step_engine)
        if window_start <= i <= end:
            stored.append(x)  # the span's inputs, and its output (the next step's input)
        v = velocity(step_engine, adapter, x, on_device[i], cond, cfg_scale, cfg_batch=cfg_batch)
        if i == num_steps - 1 and final_is_prediction:
            final = x - float(sigmas[i]) * v
        if window_start <= i < end:
            if tail is not None and i == end - 1:
                last_prediction = (x - float(sigmas[i]) * v, float(sigmas[i]))
            step = rule.step(x, v, sigmas, i, generator=generator)
            x = step.prev_sample
            log_probs.append(step.log_prob)
            if keep_means:
                means.append(step.prev_sample_mean)
        elif solver is not None:
            x = solver.step(x, v, sigmas, i)
        else:
            x = ode_step(x, v, float(sigmas[i]), float(sigmas[i + 1]))
    if end == stop:
        stored.append(x)  # the span ends where this loop does: its output is the loop's last latent
    if tail is not None:
        step_engine = engine if hold is None else hold(engine)
        x = _run_tail(step_engine, adapter, x, cond, cfg_scale, cfg_batch, tail, last_prediction)
    log_prob_table = torch.stack(log_probs, dim=1) if log_probs else x.new_zeros((x.shape[0], 0))
    return Trajectory(
        torch.stack(stored, dim=1),
        log_prob_table,
        window_start,
        _final(adapter, x if final is None else final, cond),
        means=torch.stack(means, dim=1) if keep_means and means else None,
    )


def _final(adapter: Any, final: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
    """The reward's latents as the family's pipeline ends (Wan2.2 TI2V: the first frame is the image's)."""
    return adapter.final_latents(final, cond) if hasattr(adapter, "final_latents") else final


def _check_tail(
    tail: DPMTail, engine, sigmas: torch.Tensor, window_size: int, end: int, num_steps: int
) -> None:
    """A tail continues a span of at least one step (its history) from the schedule's sigma after it, on a model
    that is one engine (a two-expert model picks its expert by the schedule's step, which a tail step is not)."""
    if window_size < 1 or end >= num_steps:
        raise ValueError(
            f"a DPM tail needs a span of at least one step that ends before the last step, got window_size="
            f"{window_size} ending at step {end} of {num_steps}; fix: no tail for such a span"
        )
    if float(tail.sigmas[0]) != float(sigmas[end]):  # CPU tensors: no device sync
        raise ValueError(
            f"the DPM tail starts at sigma {float(tail.sigmas[0])!r}, the schedule's sigma after the span (step "
            f"{end}) is {float(sigmas[end])!r}; fix: build the tail from the schedule the rollout runs "
            "(dpm.compressed_tail on the shifted linspace: flowgrpo.schedule=linspace)"
        )
    if hasattr(engine, "for_step"):
        raise ValueError(
            "a DPM tail runs off the schedule's steps, and a two-expert model picks its expert by step; fix: "
            "flowgrpo.mix_tail_solver=euler"
        )


def _run_tail(engine, adapter, x, cond, cfg_scale, cfg_batch, tail: DPMTail, history) -> torch.Tensor:
    """The tail's steps from ``x`` at ``tail.sigmas[0]`` to 0 (``dpm.dpm_solver_pp_step``)."""
    sig = tail.sigmas.tolist()  # host floats: the step's coefficients cost no device sync
    timesteps = to_device(tail.timesteps, x.device)  # queued once; indexed there
    for j in range(tail.num_steps):
        v = velocity(engine, adapter, x, timesteps[j], cond, cfg_scale, cfg_batch=cfg_batch)
        x0 = x - sig[j] * v
        x = dpm_solver_pp_step(x, x0, sig[j], sig[j + 1], history, tail.solver_type)
        history = (x0, sig[j])
    return x


class _Windows:
    """Per-sample windows as the device needs them, built on the host from the starts and copied once: the
    ``[N, B]`` mask of the samples inside their window at each step, and for step i the rows inside and their
    positions in the window (slices of one packed tensor, cut at host offsets)."""

    def __init__(self, starts: list[int], size: int, num_steps: int, device: torch.device) -> None:
        inside = [[s <= i < s + size for s in starts] for i in range(num_steps)]
        rows, pos, self.offsets = [], [], [0]
        for i in range(num_steps):
            here = [b for b, yes in enumerate(inside[i]) if yes]
            rows += here
            pos += [i - starts[b] for b in here]
            self.offsets.append(len(rows))
        self.mask = to_device(torch.tensor(inside), device)
        packed = to_device(torch.tensor([*rows, *pos], dtype=torch.long), device)
        self.rows, self.pos = packed[: len(rows)], packed[len(rows) :]

    def count(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def at(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        cut = slice(self.offsets[i], self.offsets[i + 1])
        return self.rows[cut], self.pos[cut]


def _rollout_per_sample(
    engine,
    adapter,
    cond,
    noise,
    schedule,
    starts,
    size,
    rule,
    generator,
    cfg_scale,
    final_is_prediction,
    cfg_batch,
    hold,
    keep_means,
) -> Trajectory:
    """:func:`rollout` with one window start per sample (``starts``, host ints)."""
    sigmas, num_steps, b = schedule.sigmas, schedule.num_steps, noise.shape[0]
    if len(starts) != b or not all(0 <= s <= num_steps - size for s in starts):
        raise ValueError(
            f"per-sample window starts {starts} with window_size={size}: need one start per sample ({b}), each in "
            f"[0, {num_steps - size}]; fix: flowgrpo.window_range within [0, {num_steps - size + 1})"
        )
    x = noise.float()
    on_device = schedule.on(x.device).timesteps
    windows = _Windows(starts, size, num_steps, x.device)
    stored = x.new_zeros(b, size + 1, *x.shape[1:])
    log_probs = x.new_zeros(b, size)
    means = x.new_zeros(b, size, *x.shape[1:]) if keep_means else None
    final = None
    if cfg_scale > 1.0 and cfg_batch:
        cond = {**cond, "cfg_pair": paired(cond)}
    for i in range(num_steps):
        step_engine = engine.for_step(i) if hasattr(engine, "for_step") else engine
        if hold is not None:
            step_engine = hold(step_engine)
        v = velocity(step_engine, adapter, x, on_device[i], cond, cfg_scale, cfg_batch=cfg_batch)
        if i == num_steps - 1 and final_is_prediction:
            final = x - float(sigmas[i]) * v
        ode = None if windows.count(i) == b else ode_step(x, v, float(sigmas[i]), float(sigmas[i + 1]))
        if windows.count(i) == 0:
            x = ode
            continue
        step = rule.step(x, v, sigmas, i, generator=generator)
        rows, pos = windows.at(i)
        inside = windows.mask[i].view(b, *([1] * (x.ndim - 1)))
        nxt = step.prev_sample if ode is None else torch.where(inside, step.prev_sample, ode)
        stored.index_put_((rows, pos), x.index_select(0, rows))  # the step's input ...
        stored.index_put_(
            (rows, pos + 1), nxt.index_select(0, rows)
        )  # ... and output, at the sample's own place
        log_probs.index_put_((rows, pos), step.log_prob.index_select(0, rows))
        if means is not None:
            means.index_put_((rows, pos), step.prev_sample_mean.index_select(0, rows))
        x = nxt
    starts_t = to_device(torch.tensor(starts, dtype=torch.long), x.device)
    steps = starts_t[:, None] + torch.arange(size, device=x.device)
    return Trajectory(
        stored,
        log_probs,
        min(starts),
        _final(adapter, x if final is None else final, cond),
        train_steps=steps,
        starts=starts_t,
        means=means,
    )
