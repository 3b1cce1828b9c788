"""The RL iteration a user pays for (``sp-diffusers plan --rl``): its communication ledger, its memory with the
rollout's weights gathered, and its seconds by phase, from fake runs of the trainer's own forward inputs.

A FlowGRPO iteration on one data-parallel rank (B = prompts per rank x group size samples; CFG doubles a forward's
batch, as the trainer runs both branches in one):

    rollout        N forwards without grad at batch B (x2): the first gathers the parameters; while they are held
                   (``rollout.gather_params``) the others gather nothing, else every forward gathers the blocks
    old_log_probs  B / M micro-batches x T forwards without grad at batch M (x2) on the same weights: the
                   recomputed old log-probs, on the micro-batches the update trains (bit for bit its arithmetic)
    reward         what the iteration waits for of the rewards' time (``--reward-seconds`` per sample on a device
                   of their own): all of it, or with ``rollout.chunks`` what the pipeline leaves exposed
    train          B / M micro-batches x T trained steps, each a forward and backward at batch M (x2)
    optimizer      one AdamW step (clipping's norm)

One fake run per layout traces the pieces in the order the trainer meets them, from the state it leaves between
iterations (the root module resharded): two rollout forwards (and two at the micro-batch, for the old log-probs),
two training micro-steps, the optimizer step, each
under a :class:`~sp_diffusers.parallel.ledger.CommLedger` (the same counting the trainer writes to metrics.jsonl, the
same bytes). What the first of a kind costs beyond the next (the rollout's gathers; the root module's own parameters,
which FSDP2 keeps gathered after a forward until a backward, and the trainer reshards after a rollout) is in the
first piece; the iteration is
``first + (count - 1) x next`` per phase. The trainer's own exchanges outside the model (the batch broadcast to
the SP group, rewards gathered over data parallelism) are not predicted: a few kilobytes that no layout changes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.compiling import COMPILE_MODES  # train.compile's
from .hardware import compute_scaled
from .models import ModelSpec, PlanError
from .shapes import CLIP_IMAGE_TOKENS, Workload

__all__ = [
    "COMPILE_SPEEDUP",
    "Ledger",
    "Pieces",
    "RLKnobs",
    "TrainerCalls",
    "compose",
    "exposed_reward_seconds",
    "iteration_inputs",
    "iteration_seconds",
    "trace_pieces",
]

Ledger = dict[tuple[str, str], tuple[int, int]]  # (phase, kind) -> (calls, bytes)

# FLUX.1-dev inference on one H100, 6.7 s -> 4.5 s with transformer.compile(fullgraph=True), the same with regional
# compilation (compile_repeated_blocks): "torch.compile and Diffusers: A Hands-On Guide to Peak Performance",
# docs.pytorch.org/devlogs/inductor/2026-05-11-torch-compile-and-diffusers (May 2026)
COMPILE_SPEEDUP = 1.5

# the width of the text a family's transformer takes (HunyuanVideo-1.5: its MLLM stream; the byT5 stream is left to
# the adapter's default, one masked row: a prompt without quoted text; LTX-2: its connectors' width, both streams)
_TEXT_DIM_KEYS = ("joint_attention_dim", "text_dim", "cap_feat_dim", "text_embed_dim", "caption_channels")


@dataclass(frozen=True)
class RLKnobs:
    """What sets an iteration's work (the trainer's keys in parentheses)."""

    num_steps: int = 16  # denoising steps per rollout (flowgrpo.num_steps)
    cfg: bool = False  # classifier-free guidance (flowgrpo.cfg_scale > 1): both branches in one forward
    trained_steps: int = 2  # T: SDE window steps trained per sample (flowgrpo.window_size)
    group_size: int = 16  # samples per prompt (flowgrpo.group_size)
    prompts_per_rank: int = 1  # prompts per data-parallel rank (flowgrpo.prompts_per_rank)
    gather: str = "auto"  # rollout.gather_params: once ("always"), per step ("never"), or auto by memory
    update_gather: str = "never"  # update.gather_params: held over an optimizer step's micro-steps, or per block
    recompute_old_log_probs: bool = True
    kl: bool = False  # a KL reference forward (adapters off, LoRA only) per trained step
    reward_seconds: float = 0.0  # a reward's seconds per sample on a device of its own (a reward server)
    chunks: int = 1  # rollout.chunks: each chunk scored while the next samples
    lag: int = 0  # update.lag: 1 trains the previous iteration's rollout while this one's is scored
    compile: str = "off"  # train.compile: off, blocks, or model (predicted as blocks: FSDP2's hooks split it)
    compile_speedup: float = COMPILE_SPEEDUP  # compiled, the no-grad forwards' compute is divided by this
    compile_train_speedup: float = 1.0  # compiled, the training micro-steps' compute is divided by this

    @property
    def samples(self) -> int:
        return self.prompts_per_rank * self.group_size

    @property
    def forward_speedup(self) -> float:
        """What divides the compute of a forward without grad (rollout, old log-probs): 1 when not compiled."""
        return 1.0 if self.compile == "off" else self.compile_speedup

    @property
    def train_speedup(self) -> float:
        """What divides the compute of a training micro-step (forward and backward): 1 when not compiled."""
        return 1.0 if self.compile == "off" else self.compile_train_speedup

    def check(self, micro_batch: int, lora: bool) -> None:
        for name, value in (
            ("--num-steps", self.num_steps),
            ("--trained-steps", self.trained_steps),
            ("--group-size", self.group_size),
            ("--prompts-per-rank", self.prompts_per_rank),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} {value!r} is invalid: it must be a positive integer")
        if self.trained_steps > self.num_steps:
            raise PlanError(f"--trained-steps {self.trained_steps} exceeds --num-steps {self.num_steps}")
        if self.samples % micro_batch:
            raise PlanError(
                f"--batch {micro_batch} (the training micro-batch) does not divide the {self.samples} samples per "
                f"rank (--prompts-per-rank {self.prompts_per_rank} x --group-size {self.group_size}); fix: a "
                "divisor of it"
            )
        for name, value in (("--gather", self.gather), ("--update-gather", self.update_gather)):
            if value not in ("auto", "always", "never"):
                raise PlanError(f"{name} {value!r}: choose auto, always or never")
        if self.kl and not lora:
            raise PlanError("--kl needs --lora-rank: the reference is the base model with the adapters off")
        if not (math.isfinite(self.reward_seconds) and self.reward_seconds >= 0):
            raise PlanError(f"--reward-seconds {self.reward_seconds!r} is invalid: seconds per sample >= 0")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or not 1 <= self.chunks <= self.samples:
            raise PlanError(
                f"--chunks {self.chunks!r} is invalid: an int in [1, {self.samples}] (the samples per rank)"
            )
        if self.lag not in (0, 1) or isinstance(self.lag, bool):
            raise PlanError(f"--lag {self.lag!r} is invalid: 0 (on-policy) or 1 (update.lag)")
        if self.lag and self.chunks > 1:
            raise PlanError(f"--chunks {self.chunks} with --lag 1: the trainer refuses it (rollout.chunks=1 there)")
        if self.compile not in COMPILE_MODES:
            raise PlanError(f"--compile {self.compile!r}: choose off, blocks or model (train.compile)")
        for name, value in (
            ("--compile-speedup", self.compile_speedup),
            ("--compile-train-speedup", self.compile_train_speedup),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise PlanError(
                    f"{name} {value!r} is invalid: a finite factor > 0 that divides the compute time (1: no "
                    "gain, below 1: slower); fix: e.g. 1.5, or leave it out"
                )


@dataclass
class Pieces:
    """Each traced piece's ledger: the rollout's first and next forwards with the weights held (``held_*``) and
    gathered per forward (``step_*``), a next forward at the micro-batch both ways (``recompute_*``: the old
    log-probs), the first and next training micro-steps, the optimizer step."""

    held_first: Ledger
    held_next: Ledger
    step_first: Ledger
    step_next: Ledger
    recompute_held: Ledger
    recompute_step: Ledger
    train_first: Ledger
    train_next: Ledger
    optimizer: Ledger
    update_first: Ledger  # the training micro-steps on weights held over an optimizer step
    update_next: Ledger

    def as_dict(self) -> dict[str, Ledger]:
        return dict(vars(self))


def _axpy(into: dict, ledger: Ledger, times: int, phase: str | None = None) -> None:
    for (p, kind), (calls, nbytes) in ledger.items():
        key = (phase or p, kind)
        c, b = into.get(key, (0, 0))
        into[key] = (c + times * calls, b + times * nbytes)


def compose(pieces: Pieces, rl: RLKnobs, micro_batch: int, held: bool, update_held: bool = False) -> Ledger:
    """The iteration's ledger of one rank: each phase's first piece plus ``count - 1`` next ones; ``held``: the
    rollout's weights gathered once; ``update_held``: the optimizer step's micro-steps on weights gathered once."""
    out: dict = {}
    first, nxt = (pieces.held_first, pieces.held_next) if held else (pieces.step_first, pieces.step_next)
    _axpy(out, first, 1)
    _axpy(out, nxt, rl.num_steps - 1)
    micro_steps = rl.samples // micro_batch * rl.trained_steps
    if rl.recompute_old_log_probs:
        recompute = pieces.recompute_held if held else pieces.recompute_step
        _axpy(out, recompute, micro_steps, phase="old_log_probs")
    train_first, train_next = (
        (pieces.update_first, pieces.update_next) if update_held else (pieces.train_first, pieces.train_next)
    )
    _axpy(out, train_first, 1)
    _axpy(out, train_next, micro_steps - 1)
    _axpy(out, pieces.optimizer, 1)
    return {k: v for k, v in out.items() if v[0]}


# ---------------------------------------------------------------------------------------------- the fake run


def iteration_inputs(spec: ModelSpec, model: torch.nn.Module, work: Workload) -> Any:
    """``inputs(batch, timestep) -> forward kwargs`` as the trainer makes them (``flowgrpo.models`` adapters: the
    one source of how each family is called), text of ``work.text_len`` tokens, masked where the family takes a
    mask; an image-conditioned built-in's condition too (:func:`_conditioned`); LTX-2's audio stream as its pipeline
    makes it (``work.audio_tokens`` latents at 24 fps, a second text stream of the video's length and mask).
    Families the trainer has no adapter for are refused."""
    from ..flowgrpo.models.adapters import build_adapter

    f = spec.family
    t, h, w = work.grid
    try:
        audio = dict(audio_frames=work.audio_tokens) if work.audio_tokens else {}  # at the default 24 fps
        adapter = build_adapter(model, h * f.patch, True, t * f.patch_t, work.text_len, 3.5, w * f.patch, **audio)
    except ValueError as err:
        raise PlanError(f"--rl: {spec.name}: {err}") from None
    condition_of = None
    if spec.condition:
        adapter, condition_of = _conditioned(spec, model, adapter)
    config = model.config
    width = next((config[k] for k in _TEXT_DIM_KEYS if k in config), None)
    pooled = config.get("pooled_projection_dim")

    def inputs(batch: int, timestep: torch.Tensor) -> dict[str, Any]:
        dtype = next(model.parameters()).dtype
        latents = torch.randn(adapter.latent_shape(batch)).to(dtype)
        embeds = torch.randn(batch, work.text_len, width).to(dtype)
        mask = torch.ones(batch, work.text_len, dtype=torch.bool)
        extra = torch.randn(batch, pooled).to(dtype) if pooled and f.kind in ("sd3", "flux") else None
        if f.kind == "ltx2":  # the connectors' audio stream: the video stream's length and mask
            return adapter.inputs(latents, timestep, embeds, mask, extra, text_2=(torch.randn_like(embeds), mask))
        if condition_of is None:
            return adapter.inputs(latents, timestep, embeds, mask, extra)
        return adapter.inputs(latents, timestep, embeds, mask, extra, condition=condition_of(batch, dtype))

    return TrainerCalls(inputs, adapter.noisy_output)


@dataclass(frozen=True)
class TrainerCalls:
    """How the trainer calls a family's transformer: ``self(batch, timestep)`` -> its forward kwargs, ``velocity(out)``
    -> the velocity the trainer reads from its output (a list for Z-Image; a slice for the conditioned families)."""

    inputs: Callable[[int, torch.Tensor], dict[str, Any]]
    velocity: Callable[[Any], torch.Tensor]

    def __call__(self, batch: int, timestep: torch.Tensor) -> dict[str, Any]:
        return self.inputs(batch, timestep)


def _conditioned(spec: ModelSpec, model: torch.nn.Module, base: Any) -> tuple[Any, Any]:
    """The trainer's conditioned adapter over ``base`` for an image-conditioned built-in, and ``condition(batch,
    dtype)``: random ``condition_*`` tensors of the shapes its pipeline gives (an edit's condition image at the
    output's size, as ``shapes.py`` counts it; Wan's first-frame latents and mask, Wan2.1's CLIP tokens)."""
    from ..flowgrpo.models.edit import FluxKontextAdapter, QwenImageEditAdapter
    from ..flowgrpo.models.i2v import WanI2VAdapter

    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    if spec.condition == "edit":
        grid, images = (base.grid_h, base.grid_w), spec.condition_images
        if spec.family.kind == "flux":
            adapter: Any = FluxKontextAdapter(**fields, condition_grid=grid)
        else:  # Qwen-Image-Edit(-Plus): each condition image's tokens after the noisy ones
            adapter = QwenImageEditAdapter(**fields, condition_grids=(grid,) * images)

        def edit(batch: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
            tokens = grid[0] * grid[1] * images
            return {"condition_latents": torch.randn(batch, tokens, base.channels).to(dtype)}

        return adapter, edit
    config = model.config
    fields["channels"] = config["out_channels"]  # the noisy latents; the input adds the condition's channels
    image_embeds = config.get("image_dim") is not None
    adapter = WanI2VAdapter(**fields, expand_timesteps=spec.condition == "ti2v", image_embeds=image_embeds)
    extra = config["in_channels"] - config["out_channels"]  # i2v: mask + first-frame latents; ti2v: none

    def i2v(batch: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        shape = (batch, extra or adapter.channels, adapter.frames, adapter.height, adapter.width)
        out = {"condition_latents": torch.randn(shape).to(dtype)}
        if image_embeds:
            out["condition_image_embeds"] = torch.randn(batch, CLIP_IMAGE_TOKENS, config["image_dim"]).to(dtype)
        return out

    return adapter, i2v


def _rollout_pair(engine: Any, inputs: Any, batch: int, held: bool, ledger: Any) -> tuple[Ledger, Ledger]:
    from ..parallel.ledger import comm_phase

    engine.model.reshard()  # as an iteration starts: the last backward resharded the root too
    hold = engine.gathered_params() if held else contextlib.nullcontext()
    with engine.eval_mode(), comm_phase("rollout"), hold:
        engine.forward(**inputs(batch, torch.tensor(500.0)))
        first = ledger.take()
        engine.forward(**inputs(batch, torch.tensor(400.0)))
        second = ledger.take()
    engine.release_params()  # as the trainer's WeightHolder closes: the root's own parameters too
    return first, second


def trace_pieces(engine: Any, inputs: TrainerCalls, rl: RLKnobs, micro_batch: int, lora: bool) -> Pieces:
    """The pieces of :class:`Pieces`, run in the order the trainer meets them (module doc), each counted."""
    from ..parallel.ledger import CommLedger, comm_phase

    ledger = CommLedger()
    factor = 2 if rl.cfg else 1
    rollout_batch, train_batch = rl.samples * factor, micro_batch * factor
    with ledger.recording():
        step_first, step_next = _rollout_pair(engine, inputs, rollout_batch, False, ledger)
        held_first, held_next = _rollout_pair(engine, inputs, rollout_batch, True, ledger)
        recompute_step = _rollout_pair(engine, inputs, train_batch, False, ledger)[1]
        recompute_held = _rollout_pair(engine, inputs, train_batch, True, ledger)[1]

        def loss_fn(eng: Any, _batch: Any) -> tuple[torch.Tensor, dict]:
            kwargs = inputs(train_batch, torch.full((train_batch,), 500.0))
            out = inputs.velocity(eng.forward(**kwargs)).float().square().mean()
            if rl.kl and lora:
                with torch.no_grad(), eng.adapters_disabled(), comm_phase("reference"):
                    reference = inputs.velocity(eng.forward(**kwargs)).float().mean()
                out = out + 0.0 * reference  # outside no_grad: the loss keeps its graph
            return out, {}

        engine.forward_backward(None, loss_fn)  # as the trainer's update calls it
        train_first = ledger.take()
        engine.forward_backward(None, loss_fn)
        train_next = ledger.take()
        engine.optimizer_step()
        optimizer = ledger.take()
        _rollout_pair(engine, inputs, rollout_batch, held=True, ledger=ledger)  # the next iteration's state
        ledger.take()
        with engine.gathered_params(backward=True):
            engine.forward_backward(None, loss_fn)
            update_first = ledger.take()
            engine.forward_backward(None, loss_fn)
            update_next = ledger.take()
        engine.optimizer_step()
        ledger.take()
    return Pieces(
        held_first, held_next, step_first, step_next, recompute_held, recompute_step, train_first, train_next,
        optimizer, update_first, update_next,
    )


# ---------------------------------------------------------------------------------------------------- time


def iteration_seconds(
    rollout_forward: dict[str, float],
    train_step: dict[str, float],
    gather_seconds: float,
    rl: RLKnobs,
    micro_batch: int,
    held: bool,
) -> dict[str, float]:
    """Seconds per phase: ``rollout_forward`` / ``train_step`` are ``hardware.step_seconds`` terms of one rollout
    forward (at the rollout's batch) and one training micro-step, eager; ``gather_seconds`` what gathering every
    parameter once takes. A gather is hidden behind the compute it overlaps (FSDP prefetches the next block).
    Compiled (``rl.compile``), each compute term is divided by its speedup before anything else (the collectives
    move the same bytes; less compute hides less of the gathers), the rewards' exposed time included."""
    rollout_forward = compute_scaled(rollout_forward, rl.forward_speedup)
    train_step = compute_scaled(train_step, rl.train_speedup)
    fwd = rollout_forward["compute"] + rollout_forward["sp_comm"]
    exposed = max(0.0, gather_seconds - rollout_forward["compute"])
    rollout = rl.num_steps * fwd + (exposed if held else rl.num_steps * exposed)
    # the old log-probs: the compute of T rollout forwards, in B / M micro-batches that each gather unless held
    micro_batches = rl.samples // micro_batch
    old = rl.trained_steps * (fwd + (0.0 if held else micro_batches * exposed)) if rl.recompute_old_log_probs else 0.0
    train = rl.samples // micro_batch * rl.trained_steps * train_step["total"]
    reward = exposed_reward_seconds(rollout, old, rl, train)
    return {
        "rollout": rollout,
        "old_log_probs": old,
        "reward": reward,
        "train": train,
        "total": rollout + old + reward + train,
    }


def exposed_reward_seconds(rollout: float, old_log_probs: float, rl: RLKnobs, train: float = 0.0) -> float:
    """The rewards' time the iteration waits for: all of it after the rollout (``chunks`` 1), else what a pipeline
    of ``chunks`` equal pieces leaves after the rollout and the old log-probs (chunk i scored from when it is
    sampled and the scoring of chunk i - 1 is done). A chunk's forwards are taken to cost their share of the
    rollout's: a GPU that a smaller batch leaves idle, or a model that per-forward overhead dominates, loses some of
    it (docs/benchmarks.md measures both). ``lag`` 1: a rollout is scored from its end until the next iteration
    needs it, after its old log-probs, an update (``train``), the next rollout and its old log-probs."""
    total = rl.samples * rl.reward_seconds
    if rl.lag:
        return max(0.0, total - (2 * old_log_probs + train + rollout))
    if rl.chunks <= 1 or total == 0.0:
        return total
    piece, score = rollout / rl.chunks, total / rl.chunks
    done = 0.0
    for i in range(1, rl.chunks + 1):
        done = max(i * piece, done) + score
    return max(0.0, done - rollout - old_log_probs)
