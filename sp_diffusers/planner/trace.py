"""One fake run: the real diffusers class, built on ``meta`` and materialised as fake tensors, through
``FSDPEngine`` at one layout on a fake process group of ``world`` ranks; ``FSDPEngine.train_step`` (forward with
grad, backward, AdamW step) and a rollout forward (no grad) under torch's memory tracker and FLOP counter.

Nothing is allocated: a 14B model at 75k tokens traces in seconds on one CPU core. The model may have fewer
blocks than the checkpoint (``blocks``): ``plan/extrapolate.py`` combines such runs into the whole model.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .fake_world import (
    PlanFakeMode,
    fake_attention_agreement,
    fake_process_group,
    mesh_outside_fake_mode,
    symmetric_small_gathers,
)
from .models import ModelSpec
from .shapes import Workload, build_inputs
from .tracker import Place, dtensor_shape_inference_untracked, make_tracker

__all__ = [
    "BLOCK_COUNT_KEYS",
    "Measure",
    "TraceRequest",
    "block_lists",
    "build_model",
    "create_optimizer_state",
    "plan_loss",
    "run_trace",
]

# the config key that sets each block list's length (the ModuleLists FSDPEngine shards block by block)
BLOCK_COUNT_KEYS = {
    "blocks": "num_layers",
    "transformer_blocks": "num_layers",
    "single_transformer_blocks": "num_single_layers",
    "layers": "n_layers",  # Z-Image's main blocks (its two refiners of n_refiner_layers stay as released)
}


@dataclass(frozen=True)
class TraceRequest:
    spec: ModelSpec
    work: Workload
    world: int
    ulysses: int = 1
    ring: int = 1
    checkpointing: bool = False
    lora_rank: int | None = None
    dtype: str = "bf16"  # "bf16": FSDP mixed precision (fp32 master weights, bf16 compute); "fp32"
    target: str = "cuda"  # "cuda": a GPU's allocation habits (foreach AdamW, no cached send buffers); "cpu"
    blocks: tuple[tuple[str, int], ...] = ()  # block counts to build; () = the spec's own
    rollout: bool = True
    # plan --rl: the iteration's knobs (plan/iteration.py); the rollout is then traced at its own batch with the
    # weights held gathered, and the iteration's pieces are counted (Measure.pieces of the train measure)
    rl: Any = None
    replicate: int = 1  # HSDP replica groups (EngineSettings.dp_replicate)
    # plan --rl, what the run gives: "all" the phases' measures and the iteration's pieces; "memory" the measures
    # without the pieces; "ledger" the pieces only (the phases still run first, unmeasured, so the pieces count
    # the same steady state). The planner counts the pieces on fewer blocks (plan/extrapolate.py: ledger_counts)
    part: str = "all"


@dataclass
class Measure:
    """What one traced phase shows: each place's peak by part, FLOPs, and bytes sent per (kind, group size)."""

    places: dict[Place, dict[str, int]]
    flops: int
    comm: dict[tuple[str, int], float] = field(default_factory=dict)
    pieces: dict[str, dict[tuple[str, str], tuple[int, int]]] = field(
        default_factory=dict
    )  # plan --rl ledgers
    per_step: Measure | None = None  # plan --rl's rollout: the forward with per-forward gathers (this: held)
    held_update: Measure | None = None  # plan --rl's train step on weights held over the micro-steps


def block_lists(spec: ModelSpec) -> dict[str, int]:
    """The block lists of ``spec``'s class and their lengths in ``spec.config`` (built on meta, no memory)."""
    with torch.device("meta"):
        model = build_model(spec, {})
    return {
        name: len(child)
        for name, child in model.named_children()
        if isinstance(child, torch.nn.ModuleList) and name in BLOCK_COUNT_KEYS
    }


def build_model(spec: ModelSpec, counts: dict[str, int]) -> torch.nn.Module:
    """``spec``'s class with ``counts`` blocks, on the current device / in the current fake mode."""
    from ..families.kinds import model_class

    config = dict(spec.config)
    for name, count in counts.items():
        config[BLOCK_COUNT_KEYS[name]] = count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(spec.kind)(**config)
    for name, count in counts.items():
        got = len(getattr(model, name))
        if got != count:  # pragma: no cover - a class whose block count is not its config key
            raise RuntimeError(
                f"{spec.class_name}.{name} has {got} blocks with {BLOCK_COUNT_KEYS[name]}={count}"
            )
    return model


@contextlib.contextmanager
def _target_habits(target: str):
    """On a GPU, ``exchange`` allocates each send buffer anew (CUDA's allocator recycles it); on CPU it keeps one.
    The fake tensors live on CPU, so a GPU plan switches the CPU cache off. Either way the cache is emptied
    after the run, so no fake tensor outlives it."""
    from ..parallel import exchange

    original = getattr(exchange, "_send_buffer", None)  # None: no CPU cache, nothing to switch
    release = getattr(exchange, "release_buffers", lambda: None)
    if target == "cuda" and original is not None:
        exchange._send_buffer = lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)
    try:
        yield
    finally:
        if original is not None:
            exchange._send_buffer = original
        release()


def _engine(req: TraceRequest, model: torch.nn.Module):
    from ..engine import FSDPEngine
    from ..engine.settings import EngineSettings, LoraSettings
    from .fake_module_to import fake_safe_module_to

    lora = None
    if req.lora_rank is not None:
        lora = LoraSettings(rank=req.lora_rank, alpha=float(req.lora_rank))
    settings = EngineSettings(
        ulysses_sequence_parallel_size=req.ulysses,
        ring_degree=req.ring,
        dp_replicate=req.replicate,
        lora=lora,
        mixed_precision="bf16" if req.dtype == "bf16" else None,
        activation_checkpointing=req.checkpointing,
        device="cpu",
    )
    with fake_safe_module_to():
        engine = FSDPEngine(model, settings)
    if req.target == "cuda":
        # a GPU's AdamW runs foreach (one temporary per parameter at once); CPU tensors default to one by one
        for group in engine.optimizer.param_groups:
            group["foreach"] = True
    return engine


def plan_loss(engine: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    try:
        out = engine.forward(**batch["inputs"])
    except Exception as err:
        # the engine shares a failure with every rank through all_gather_object, which cannot run on the fake
        # process group: keep the error to raise it in its own words
        batch["error"] = err
        raise
    if isinstance(out, (list, tuple)):  # Z-Image: one output per sample; LTX-2: (video, audio)
        return sum(o.float().square().mean() for o in out) / len(out), {}
    return out.float().square().mean(), {}


def run_trace(req: TraceRequest) -> tuple[Measure, Measure | None]:
    """Trace one train step (and a rollout forward when ``req.rollout``) at ``req``'s layout; returns their
    measures. The step is a running job's: AdamW's moments exist from its start (an untraced step on zero
    gradients creates them first, as a job's first step does)."""
    import sp_diffusers

    from ..parallel.exchange import release_buffers

    sp_diffusers.install()
    counts = dict(req.blocks)
    quiet = logging.getLogger("diffusers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    release_buffers()
    # diffusers' hooks keep a model in reference cycles: what an earlier run left is freed now, not by a
    # collection in the middle of this run's trace, and this run's model is freed before it returns
    gc.collect()
    # the collector's full passes would walk every object of torch and diffusers again and again (a third of a
    # trace's time); what exists now outlives the trace, so it is set aside (plan/workers.py does so for good)
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    model = engine = batch = None
    try:
        with (
            warnings.catch_warnings(),
            fake_process_group(req.world),
            PlanFakeMode(),
            mesh_outside_fake_mode(),
            symmetric_small_gathers(),
            fake_attention_agreement(),
            dtensor_shape_inference_untracked(),
            _target_habits(req.target),
        ):
            warnings.simplefilter("ignore")
            # built in fake mode, not on meta: tensors a model keeps outside its parameters and buffers (RoPE
            # tables) must be on the device too
            model = build_model(req.spec, counts)
            lists = {
                name: len(child)
                for name, child in model.named_children()
                if isinstance(child, torch.nn.ModuleList) and name in BLOCK_COUNT_KEYS
            }
            engine = _engine(req, model)
            inputs = build_inputs(req.spec, engine.model, req.work)
            batch = {"inputs": inputs}
            create_optimizer_state(engine)
            measure = req.part != "ledger"
            try:
                train = _traced(engine, lists, inputs, lambda: engine.train_step(batch, plan_loss), measure)
            except Exception:
                if "error" in batch:
                    raise batch["error"] from None
                raise
            rollout = None
            if req.rl is not None:
                rollout, train.pieces, train.held_update = _iteration(req, engine, lists, batch)
            elif req.rollout:
                rollout = _traced(engine, lists, inputs, lambda: _rollout(engine, inputs))
    finally:
        if model is not None:
            # a model kept alive by anything (a traceback, a caller's frame) must not block uninstall(); with
            # diffusers' logger still quiet: it warns that attention backends are experimental at every reset
            model.reset_attention_backend()
        quiet.setLevel(level)
        model = engine = batch = None
        gc.collect()
        if freeze:
            gc.unfreeze()
    return train, rollout


def _iteration(
    req: TraceRequest, engine: Any, lists: dict[str, int], batch: dict[str, Any]
) -> tuple[Measure, dict, Measure | None]:
    """plan --rl: a rollout forward at the rollout's batch with the weights held (its peak holds them all), the
    train step on weights held over its micro-steps (``update.gather_params``), then the iteration's pieces,
    counted (``plan/iteration.py``)."""
    from .iteration import iteration_inputs, trace_pieces

    rl = req.rl
    make = iteration_inputs(req.spec, engine.model, req.work)
    micro = req.work.batch // (2 if rl.cfg else 1)  # the train trace's batch holds both CFG branches
    rollout_inputs = make(rl.samples * (2 if rl.cfg else 1), torch.tensor(500.0))
    engine.model.reshard()

    def held_forward() -> None:
        with engine.eval_mode(), engine.gathered_params():
            engine.forward(**rollout_inputs)

    def per_step_forward() -> None:
        with engine.eval_mode():
            engine.forward(**rollout_inputs)

    measure = req.part != "ledger"
    rollout = _traced(engine, lists, rollout_inputs, held_forward, measure)
    if rl.gather != "always":
        engine.model.reshard()
        rollout.per_step = _traced(engine, lists, rollout_inputs, per_step_forward, measure)
    held_update = None
    if rl.update_gather != "never":

        def held_step() -> None:
            engine.zero_grad()
            with engine.gathered_params(backward=True):
                engine.forward_backward(batch, plan_loss)
            engine.optimizer_step()

        engine.release_params()
        held_update = _traced(engine, lists, batch["inputs"], held_step, measure)
    if req.part == "memory":
        return rollout, {}, held_update
    pieces = trace_pieces(engine, make, rl, micro, req.lora_rank is not None)
    return rollout, pieces.as_dict(), held_update


def _rollout(engine: Any, inputs: dict[str, Any]) -> None:
    with engine.eval_mode():
        engine.forward(**inputs)


def _traced(
    engine: Any, lists: dict[str, int], inputs: dict[str, Any], step: Any, measure: bool = True
) -> Measure:
    if not measure:  # a ledger run: the step runs for the state it leaves
        step()
        return Measure({}, 0)
    tensors = tuple(v for v in inputs.values() if torch.is_tensor(v))
    tracker = make_tracker(engine.model, engine.optimizer, lists, tensors)
    try:
        with tracker:
            tracker.start()
            step()
    finally:
        tracker.remove_hooks()
    return Measure(tracker.places(), tracker.flops, dict(tracker.comm))


def create_optimizer_state(engine: Any) -> None:
    """One optimizer step on zero gradients, untraced: AdamW creates its moments in its first step, and a running
    job's step (the one predicted) starts with them."""
    for p in engine.trainable:
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.zero_grad()
