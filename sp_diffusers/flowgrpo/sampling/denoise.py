"""The one denoising loop: noise to data along a schedule, some steps stochastic. Rollouts (every algorithm's), the
DPM-Solver++ tail, evaluation and the sample grids all run :func:`denoise`; training evaluates one stored step with
:func:`evaluate_step`, the same velocity and step rule.

At each schedule step the model gives a velocity (:func:`velocity`: classifier-free guidance in one forward of both
branches, or two); then each sample takes its step:

- inside the :class:`Span` (its window of stochastic steps): the SDE step of ``span.rule``, whose log-prob makes the
  policy; the step's input and output are stored at the sample's own positions of ``Trajectory.latents``;
- outside it: the deterministic step, Euler or ``span.solver`` (DiffusionNFT's ``dpm2``);
- after the span, with ``span.tail`` (MixGRPO): DPM-Solver++ on the tail's own compressed sigmas instead of the
  schedule's remaining steps, its history the span's last data prediction.

One start for every sample, or one per sample (verl-omni's ``sample_per_sample_sde_windows``): at a step where some
samples are inside their window and others not, the SDE and the Euler step are both computed for the batch and each
sample takes its own (``torch.where``: bit for bit each step alone). Which samples are where is known on the host
from the starts; the tables that say so reach the device once per run, so no step waits on the device.

Every rank of an SP group calls this with the same batch and the same generator seed, so the noise, the span and the
latents are identical there; the transformer's Ulysses attention does the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...parallel.devices import to_device
from .dpm import DPMTail, dpm_solver_pp_step
from .guidance import guided, paired
from .pipeline_schedule import Schedule
from .sde import SDEStep, StepRule, ode_step
from .trajectory import Trajectory

__all__ = ["BatchNoise", "ChunkNoise", "Sampler", "Span", "denoise", "denoise_in_chunks", "evaluate_step", "velocity"]

_TEXT = ("prompt_embeds", "prompt_embeds_mask", "pooled_prompt_embeds")


def velocity(
    engine: Any,
    adapter: Any,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    cond: dict[str, Any],
    cfg_scale: float = 1.0,
    cfg_batch: bool = True,
) -> torch.Tensor:
    """``engine``'s velocity (float32) at ``latents`` and the model timestep ``timestep`` (0-d or ``[B]``, 0..1000
    scale); with ``cfg_scale > 1`` classifier-free guidance, both branches in one forward of 2B samples
    (``cfg_batch``; ``guidance.py``: ``cond["cfg_pair"]`` when the caller stacked them once) or in two."""
    dtype = next(engine.model.parameters()).dtype
    x = latents.to(dtype)

    def forward(x: torch.Tensor, t: torch.Tensor, text: dict[str, Any], prefix: str = "") -> torch.Tensor:
        # an image-conditioned family joins its condition_* tensors to the input and returns the noisy tokens' part
        # of the output (models/conditioning.py)
        embeds, mask, pooled = (text[prefix + _TEXT[0]], text[prefix + _TEXT[1]], text.get(prefix + _TEXT[2]))
        condition = {k: v for k, v in text.items() if k.startswith("condition_")}
        extra: dict[str, Any] = {"condition": condition} if condition else {}
        # each row's valid text length as host ints (Z-Image's: models/conditioning.PromptEncoder)
        if text.get(prefix + "prompt_embeds_lengths") is not None:
            extra["lengths"] = text[prefix + "prompt_embeds_lengths"]
        if text.get(prefix + "prompt_embeds_2") is not None:  # a second text stream (HunyuanVideo-1.5's byT5)
            extra["text_2"] = (text[prefix + "prompt_embeds_2"].to(dtype), text[prefix + "prompt_embeds_mask_2"])
        out = engine.forward(**adapter.inputs(x, t, embeds.to(dtype), mask, pooled, **extra))
        return adapter.noisy_output(out)

    def run(x: torch.Tensor, t: torch.Tensor, text: dict[str, Any], prefix: str = "") -> torch.Tensor:
        groups = _count_groups(text)
        if groups is None:
            return forward(x, t, text, prefix)
        return _by_count(forward, groups, x, t, text, prefix)

    if cfg_scale > 1.0 and cfg_batch:
        both = cond.get("cfg_pair") or paired(cond)
        t = timestep if timestep.dim() == 0 else torch.cat([timestep, timestep])
        v, v_neg = run(torch.cat([x, x]), t, both).chunk(2)
        return guided(v, v_neg, cfg_scale).float()
    v = run(x, timestep, cond)
    if cfg_scale > 1.0:
        v = guided(v, run(x, timestep, cond, "negative_"), cfg_scale)
    return v.float()


def _count_groups(text: dict[str, Any]) -> list[tuple[int, list[int]]] | None:
    """A multi-image edit batch's forwards: ``(count, rows)`` for each count of ``condition_groups`` (every rank's
    counts, ``conditioning.agreed_count_groups``; else this batch's own), its rows by ``condition_counts`` (host ints:
    no device sync); an empty ``rows`` where this batch has no row of that count. None: one forward (no counts, or
    a single group)."""
    counts = text.get("condition_counts")
    if counts is None:
        return None
    groups = text.get("condition_groups") or sorted(set(counts))
    if len(groups) < 2:
        return None
    return [(c, [i for i, n in enumerate(counts) if n == c]) for c in groups]


def _by_count(
    forward: Callable[..., torch.Tensor],
    groups: list[tuple[int, list[int]]],
    x: torch.Tensor,
    t: torch.Tensor,
    text: dict[str, Any],
    prefix: str,
) -> torch.Tensor:
    """One forward per count of condition images (the Qwen-Image transformer has no mask over image tokens: rows of
    different counts cannot share one by padding), the velocities put back in row order. Each group's rows are cut
    from every per-row entry of ``text`` with one index tensor built on the host and queued to the device; the
    adapter cuts the group's condition tokens from the padded ones (``edit.QwenImageEditAdapter.inputs``). A count
    this batch has none of (another rank's) runs a stand-in: the first row as that count, its output joined to the
    result with weight 0, so that every rank runs the same forwards (and backwards) in the same order."""
    b = x.shape[0]
    rows = [i for _, r in groups for i in (r or [0])]  # each forward's rows, one after the other
    order = [0] * b  # where row i's velocity is in the real groups' outputs, concatenated
    for at, i in enumerate(i for _, r in groups for i in r):
        order[i] = at
    index = to_device(torch.tensor([*rows, *order], dtype=torch.long), x.device)  # one queued copy
    picks, inverse = index[: len(rows)], index[len(rows) :]
    outs, stand_ins, start = [], [], 0
    for count, r in groups:
        pick = picks[start : start + (len(r) or 1)]
        start += len(r) or 1
        part = _rows(text, pick, r or [0], b)
        if not r:
            part["condition_counts"] = [count]
        v = forward(x.index_select(0, pick), t.index_select(0, pick) if t.dim() else t, part, prefix)
        (outs if r else stand_ins).append(v)
    out = torch.cat(outs).index_select(0, inverse)
    for v in stand_ins:
        out = out + 0.0 * v.sum()  # in the graph: its backward runs (and gathers) as a peer's real group's does
    return out


def _rows(text: dict[str, Any], pick: torch.Tensor, host: list[int], b: int) -> dict[str, Any]:
    """The per-row entries of ``text`` (tensors and host lists of ``b`` rows) at rows ``pick`` (on the device) /
    ``host`` (the same, on the host); what is not per row (``condition_groups``) as it is."""
    out: dict[str, Any] = {}
    for key, value in text.items():
        if torch.is_tensor(value) and value.dim() and value.shape[0] == b:
            out[key] = value.index_select(0, to_device(pick, value.device))
        elif isinstance(value, list) and len(value) == b:
            out[key] = [value[i] for i in host]
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Sampler:
    """The model a denoising run calls and how: ``engine`` (one model, or two experts: ``engine.for_step(i)`` runs
    schedule step i), the family's ``adapter``, the ``schedule``, classifier-free guidance, and ``hold`` (each step's
    engine passes through it: ``guidance.WeightHolder``, weights gathered once)."""

    engine: Any
    adapter: Any
    schedule: Schedule
    cfg_scale: float = 1.0
    cfg_batch: bool = True
    hold: Callable[[Any], Any] | None = None

    def engine_at(self, step: int) -> Any:
        engine = self.engine.for_step(step)
        return engine if self.hold is None else self.hold(engine)

    def velocity(self, engine: Any, x: torch.Tensor, timestep: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        return velocity(engine, self.adapter, x, timestep, cond, self.cfg_scale, self.cfg_batch)


@dataclass(frozen=True)
class Span:
    """Which steps are stochastic: ``[start, start + size)`` of the schedule, ``start`` one int for every sample or
    one per sample (host ints); ``rule`` their SDE step. The other steps: ``solver`` (``step(x, v, sigmas, i)``;
    None: Euler), and after the span ``tail`` (DPM-Solver++ on its own sigmas; None: the schedule's steps)."""

    start: int | Sequence[int] = 0
    size: int = 0
    rule: StepRule | None = None
    solver: Any = None
    tail: DPMTail | None = None

    @property
    def per_sample(self) -> bool:
        return not isinstance(self.start, int)


def evaluate_step(
    sampler: Sampler,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    step_index: int | torch.Tensor,
    cond: dict[str, Any],
    rule: StepRule,
) -> SDEStep:
    """The log-prob (and step mean) of the stored ``next_latents`` under ``sampler.engine``'s current policy at
    schedule step ``step_index`` (an int, or ``[B]`` long when each sample trains on its own step, as DanceGRPO's
    do; the caller routes a two-expert model: every sample's step then runs on one expert). Indexed where the latents
    are: a per-sample index never travels to the host."""
    schedule = sampler.schedule
    timestep = schedule.on(latents.device).timesteps[to_device(step_index, latents.device)]
    v = sampler.velocity(sampler.engine, latents, timestep, cond)
    return rule.step(latents, v, schedule.sigmas, step_index, prev_sample=next_latents)


class _Windows:
    """Where each sample's window is, as the device needs it, built on the host from the starts and copied once:
    the ``[N, B]`` mask of the samples inside their window at each step, and for step i the rows inside and their
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


class BatchNoise:
    """A whole batch's SDE noise, drawn as an unchunked rollout of the batch draws it: at each step where some
    sample of the batch is inside its window, one ``[B, ...]`` standard normal from ``generator``, in step order.
    A rollout run in chunks (:func:`denoise_in_chunks`) takes each chunk's rows of these draws, so it samples the
    noise the batch would have in one piece (the draws are kept until the last chunk has run: the size of the
    span's stored latents)."""

    def __init__(self, generator: torch.Generator, starts: list[int], size: int) -> None:
        self.generator, self.batch = generator, len(starts)
        ends = max(starts) + size if starts else 0
        self.drawing = [i for i in range(ends) if any(s <= i < s + size for s in starts)]
        self.draws: dict[int, torch.Tensor] = {}

    def rows(self, step: int, rows: slice, like: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of step ``step``'s draw, shaped and placed like ``like`` (a chunk's latents)."""
        while len(self.draws) < len(self.drawing) and self.drawing[len(self.draws)] <= step:
            device = self.generator.device
            shape = (self.batch, *like.shape[1:])
            eps = torch.randn(shape, generator=self.generator, dtype=like.dtype, device=device)
            self.draws[self.drawing[len(self.draws)]] = eps
        return to_device(self.draws[step][rows], like.device)


@dataclass(frozen=True)
class ChunkNoise:
    """The noise of the chunk ``rows`` of a batch whose noise is ``batch``."""

    batch: BatchNoise
    rows: slice


def _check(span: Span, sampler: Sampler, batch: int) -> list[int]:
    """Every sample's start (host ints), after refusing a span that does not fit the schedule."""
    num_steps, size = sampler.schedule.num_steps, span.size
    starts = list(span.start) if span.per_sample else [int(span.start)] * batch
    if size < 0 or len(starts) != batch or not all(0 <= s <= num_steps - size for s in starts):
        raise ValueError(
            f"span start {span.start} with size {size} does not fit {num_steps} steps for {batch} samples; fix: "
            f"flowgrpo.window_range within [0, {num_steps - size + 1})"
        )
    if size and span.rule is None:
        raise ValueError("a span of stochastic steps needs its step rule; fix: Span(rule=StepRule(...))")
    if span.per_sample and (span.solver is not None or span.tail is not None):
        raise ValueError("per-sample windows take the Euler step outside the windows; fix: solver=None, tail=None")
    if span.tail is not None:
        end, sigmas = starts[0] + size, sampler.schedule.sigmas
        if size < 1 or end >= num_steps:
            raise ValueError(
                f"a DPM tail needs a span of at least one step that ends before the last step, got a span of {size} "
                f"ending at step {end} of {num_steps}; fix: no tail for such a span"
            )
        if float(span.tail.sigmas[0]) != float(sigmas[end]):  # CPU tensors: no device sync
            raise ValueError(
                f"the DPM tail starts at sigma {float(span.tail.sigmas[0])!r}, the schedule's sigma after the span "
                f"(step {end}) is {float(sigmas[end])!r}; fix: build the tail from the schedule the rollout runs "
                "(dpm.compressed_tail on the shifted linspace: flowgrpo.schedule=linspace)"
            )
        if sampler.engine.num_experts > 1:
            raise ValueError(
                "a DPM tail runs off the schedule's steps, and a two-expert model picks its expert by step; fix: "
                "flowgrpo.mix.tail_solver=euler"
            )
    return starts


@torch.no_grad()
def denoise(
    sampler: Sampler,
    cond: dict[str, Any],
    noise: torch.Tensor,
    span: Span = Span(),
    generator: torch.Generator | ChunkNoise | None = None,
    keep_means: bool = False,
    final_is_prediction: bool = False,
) -> Trajectory:
    """Denoise ``noise`` from sigma 1 to 0 (module docstring). ``generator`` draws the SDE steps' noise (the same
    seed on every rank of an SP group; a ``ChunkNoise``: this chunk's rows of its batch's draws); ``keep_means``:
    the span's step means are stored too; ``final_is_prediction``: the rewards read the last step's predicted data ``x - sigma v`` instead of the last
    latent (DanceGRPO). A span of 0 steps stores the latent at its start alone, and no log-prob."""
    x = noise.float()
    b, schedule = x.shape[0], sampler.schedule
    starts = _check(span, sampler, b)
    sigmas, num_steps, size = schedule.sigmas, schedule.num_steps, span.size  # sigmas: the CPU copy, read on the host
    end = starts[0] + size
    stop = num_steps if span.tail is None else end  # the schedule's steps this loop runs; the tail runs the rest
    timesteps = schedule.on(x.device).timesteps  # each step's timestep indexed there, not copied from the host
    windows = _Windows(starts, size, stop, x.device)
    stored = x.new_zeros(b, size + 1, *x.shape[1:])
    log_probs = x.new_zeros(b, size)
    means = x.new_zeros(b, size, *x.shape[1:]) if keep_means else None
    if size == 0 and starts[0] == 0:
        stored[:, 0] = x
    final = None
    history = None  # (x0, sigma) of the span's last step: the tail's
    if sampler.cfg_scale > 1.0 and sampler.cfg_batch:
        cond = {**cond, "cfg_pair": paired(cond)}  # stacked once, read by every step
    for i in range(stop):
        v = sampler.velocity(sampler.engine_at(i), x, timesteps[i], cond)
        sigma = float(sigmas[i])
        if i == num_steps - 1 and final_is_prediction:
            final = x - sigma * v
        inside = windows.count(i)
        if inside < b:
            det = span.solver.step(x, v, sigmas, i) if span.solver is not None else ode_step(x, v, sigma, float(sigmas[i + 1]))
        if inside == 0:
            x = det
            if size == 0 and i + 1 == starts[0]:
                stored[:, 0] = x
            continue
        if span.tail is not None and i == end - 1:
            history = (x - sigma * v, sigma)
        if isinstance(generator, ChunkNoise):
            step = span.rule.step(x, v, sigmas, i, noise=generator.batch.rows(i, generator.rows, x))
        else:
            step = span.rule.step(x, v, sigmas, i, generator=generator)
        nxt = step.prev_sample if inside == b else torch.where(windows.mask[i].view(b, *[1] * (x.ndim - 1)), step.prev_sample, det)
        rows, pos = windows.at(i)
        stored.index_put_((rows, pos), x.index_select(0, rows))  # the step's input ...
        stored.index_put_((rows, pos + 1), nxt.index_select(0, rows))  # ... and output, at the sample's own place
        log_probs.index_put_((rows, pos), step.log_prob.index_select(0, rows))
        if means is not None:
            means.index_put_((rows, pos), step.prev_sample_mean.index_select(0, rows))
        x = nxt
    if span.tail is not None:
        x = _tail(sampler, x, cond, span.tail, history)
    trajectory = Trajectory(stored, log_probs, min(starts), sampler.adapter.final_latents(x if final is None else final, cond), means=means)
    if span.per_sample:
        first = to_device(torch.tensor(starts, dtype=torch.long), x.device)
        trajectory.starts = first
        trajectory.train_steps = first[:, None] + torch.arange(size, device=x.device)
    return trajectory


def denoise_in_chunks(
    sampler: Sampler,
    cond_of: Callable[[slice], dict[str, Any]],
    noise: torch.Tensor,
    span: Span,
    generator: torch.Generator,
    chunks: int,
    keep_means: bool = False,
    final_is_prediction: bool = False,
    on_chunk: Callable[[slice, Trajectory], None] | None = None,
) -> Trajectory:
    """:func:`denoise` of the batch ``noise`` in ``chunks`` consecutive pieces, ``on_chunk(rows, trajectory)``
    called as each is done (``rollout.chunks``: its rewards are scored while the next piece samples). The pieces
    take the SDE noise the whole batch would take (``BatchNoise``), so the result is the one-piece rollout's up to
    the rounding of a smaller batch. ``cond_of(rows)``: the conditioning of samples ``rows``."""
    b = noise.shape[0]
    starts = _check(span, sampler, b)
    shared = BatchNoise(generator, starts, span.size)
    parts = []
    for piece in torch.arange(b).tensor_split(chunks):
        if not piece.numel():
            continue
        rows = slice(int(piece[0]), int(piece[-1]) + 1)
        piece_span = replace(span, start=starts[rows]) if span.per_sample else span
        traj = denoise(
            sampler, cond_of(rows), noise[rows], piece_span, ChunkNoise(shared, rows), keep_means, final_is_prediction
        )
        if on_chunk is not None:
            on_chunk(rows, traj)
        parts.append(traj)
    return Trajectory.cat(parts)


def _tail(sampler: Sampler, x: torch.Tensor, cond: dict[str, Any], tail: DPMTail, history: Any) -> torch.Tensor:
    """The tail's steps from ``x`` at ``tail.sigmas[0]`` to 0 (``dpm.dpm_solver_pp_step``), on the one engine."""
    engine = sampler.engine if sampler.hold is None else sampler.hold(sampler.engine)
    sig = tail.sigmas.tolist()  # host floats: the step's coefficients cost no device sync
    timesteps = to_device(tail.timesteps, x.device)  # queued once; indexed there
    for j in range(tail.num_steps):
        v = sampler.velocity(engine, x, timesteps[j], cond)
        x0 = x - sig[j] * v
        x = dpm_solver_pp_step(x, x0, sig[j], sig[j + 1], history, tail.solver_type)
        history = (x0, sig[j])
    return x
