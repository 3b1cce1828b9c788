"""Which layout fits: every (ulysses, ring, dp) that divides the GPUs (Ulysses also dividing the heads), with
activation checkpointing on and off, each traced through the engine on fake tensors (``plan/trace.py``, the block
shortcut of ``plan/extrapolate.py``), with per-GPU memory by part, whether it fits, the estimated step time
(``plan/hardware.py``) and the recommended layout: the highest throughput that fits.

The quantity predicted (docs/planning.md): the per-GPU peak of one ``FSDPEngine.train_step`` on one micro-batch of
that size at that layout (forward with grad, backward, AdamW step, the optimizer state of a running job), and of
the rollout's forward without grad on the same GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from .extrapolate import combine, grown_pieces, ledger_counts, shortcut_counts
from .hardware import Hardware, step_seconds
from .iteration import COMPILE_SPEEDUP, Pieces, RLKnobs, compose, iteration_seconds
from .layouts import checkpointing, layouts, replicates
from .models import ModelSpec, PlanError
from .shapes import Workload
from .trace import Measure, TraceRequest, block_lists
from .tracker import PARTS
from .workers import run_all

__all__ = ["LayoutPlan", "Plan", "PlanRequest", "make_plan"]

GIB = 1 << 30


@dataclass(frozen=True)
class PlanRequest:
    spec: ModelSpec
    work: Workload
    gpus: int
    hardware: Hardware
    dtype: str = "bf16"
    lora_rank: int | None = None
    ulysses: int | None = None  # fixed degree; None: enumerate
    ring: int | None = None
    checkpointing: str = "auto"  # "on" | "off" | "auto" (both)
    reserve_gib: float | None = None  # None: 2 GiB + 5% of the GPU's memory
    target: str = "cuda"  # "cpu": predict a CPU process (the accuracy benchmark)
    workers: int | None = None  # trace processes; None: one per CPU core (at most 4); 1: in this process
    shortcut: bool = True  # the block shortcut; False traces the whole model (slow; tests)
    rl: RLKnobs | None = None  # plan --rl: the RL iteration (plan/iteration.py); work.batch is the micro-batch
    nodes: int = 1  # the GPUs' nodes (hardware.gpus_per_node = gpus / nodes); > 1 also plans HSDP per node
    replicate: int | None = None  # fixed HSDP replica count (parallel.dp_replicate); None: layouts.replicates

    @property
    def reserve(self) -> float:
        if self.reserve_gib is not None:
            return self.reserve_gib
        return 2.0 + 0.05 * self.hardware.memory_gib


@dataclass
class LayoutPlan:
    ulysses: int
    ring: int
    dp: int
    activation_checkpointing: bool
    replicate: int = 1  # HSDP replica groups (parallel.dp_replicate); 1: FSDP over every GPU
    peak_bytes: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    where: str = ""  # the place of the peak
    start_bytes: int = 0  # held when the step starts (parameters, optimizer state, micro-batch)
    rollout_peak_bytes: int = 0
    flops: int = 0
    comm_bytes: dict[str, float] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    samples_per_second: float = 0.0
    fits: bool = False
    iteration: dict[str, Any] = field(default_factory=dict)  # plan --rl: seconds by phase, throughput, ledger

    def to_json(self) -> dict[str, Any]:
        return {
            "ulysses": self.ulysses,
            "ring": self.ring,
            "dp": self.dp,
            "replicate": self.replicate,
            "activation_checkpointing": self.activation_checkpointing,
            "peak_bytes": self.peak_bytes,
            "parts": dict(self.parts),
            "peak_at": self.where,
            "start_bytes": self.start_bytes,
            "rollout_peak_bytes": self.rollout_peak_bytes,
            "fits": self.fits,
            "step_seconds": self.step.get("total", 0.0),
            "step_terms_seconds": {k: v for k, v in self.step.items() if k != "total"},
            "samples_per_second": self.samples_per_second,
            "flops_per_gpu": self.flops,
            "comm_bytes_per_gpu": dict(self.comm_bytes),
            **({"iteration": self.iteration} if self.iteration else {}),
        }


@dataclass
class Plan:
    request: PlanRequest
    layouts: list[LayoutPlan]
    recommended: LayoutPlan | None
    notes: list[str]


def _check(req: PlanRequest) -> None:
    if req.dtype not in ("bf16", "fp32"):
        raise PlanError(f"--dtype {req.dtype!r}: choose bf16 or fp32")
    if req.lora_rank is not None and (
        isinstance(req.lora_rank, bool) or not isinstance(req.lora_rank, int) or req.lora_rank < 1
    ):
        raise PlanError(
            f"--lora-rank {req.lora_rank!r} is invalid: a positive integer (leave it out for full fine-tuning)"
        )
    if req.rl is not None:
        req.rl.check(req.work.batch, req.lora_rank is not None)
    if req.reserve_gib is not None and not 0 <= req.reserve_gib < req.hardware.memory_gib:
        raise PlanError(
            f"--reserve {req.reserve_gib} GiB must be >= 0 and below --gpu-memory {req.hardware.memory_gib}"
        )


def _combos(req: PlanRequest) -> list[tuple[int, int, int]]:
    """Every (ulysses, ring, replicate) to plan."""
    return [(u, r, rep) for u, r in layouts(req) for rep in replicates(req, u, r)]


def _counts(req: PlanRequest, lists: dict[str, int]) -> list[tuple[dict[str, int], str]]:
    """The runs of one layout: (block counts, part). With the shortcut and ``--rl``, the phases' measures on
    three and four blocks and the iteration's pieces on one and two (``plan/extrapolate.py``)."""
    if not req.shortcut:
        return [(lists, "all")]
    if req.rl is None:
        return [(c, "all") for c in shortcut_counts(lists)]
    return [(c, "memory") for c in shortcut_counts(lists)] + [(c, "ledger") for c in ledger_counts(lists)]


def _tasks(req: PlanRequest, lists: dict[str, int]) -> list[TraceRequest]:
    counts = _counts(req, lists)
    # --rl: a training micro-step runs both CFG branches in one forward
    work = replace(req.work, batch=req.work.batch * 2) if req.rl is not None and req.rl.cfg else req.work
    tasks = []
    for u, r, rep in _combos(req):
        for i, ckpt in enumerate(checkpointing(req)):
            for c, part in counts:
                tasks.append(
                    TraceRequest(
                        req.spec,
                        work,
                        req.gpus,
                        u,
                        r,
                        ckpt,
                        req.lora_rank,
                        req.dtype,
                        req.target,
                        tuple(c.items()),
                        rollout=i == 0,
                        rl=req.rl,
                        replicate=rep,
                        part=part,
                    )
                )
    return tasks


def _allowance(req: PlanRequest) -> tuple[int, int]:
    """On a GPU, FSDP2 gathers the next block while one computes, and reduce-scatters the last block's gradients
    while the next computes: one more block's gathered parameters (forward and backward) and gradients (backward)
    than a CPU run shows. (bytes in forward, bytes in backward)"""
    if req.target != "cuda" or req.gpus == 1:
        return 0, 0
    import torch

    from .trace import build_model

    with torch.device("meta"):
        model = build_model(req.spec, {name: 1 for name in block_lists(req.spec)})
    lists = [b for name in block_lists(req.spec) for b in getattr(model, name)[:1]]
    params = max(sum(p.numel() for p in b.parameters()) for b in lists)
    gathered = params * (2 if req.dtype == "bf16" else 4)
    if req.lora_rank is None:
        grads = params * 4
    else:
        grads = (
            max(
                sum(
                    req.lora_rank * (m.in_features + m.out_features)
                    for n, m in b.named_modules()
                    if _lora_target(n, m)
                )
                for b in lists
            )
            * 4
        )
    return gathered, gathered + grads


def _lora_target(name: str, module: Any) -> bool:
    from ..engine.settings import LoraSettings

    return hasattr(module, "in_features") and any(name.endswith(t) for t in LoraSettings().target_modules)


_PHASES = {
    "start": "step start",
    "fw": "forward",
    "bw": "backward",
    "post": "gradient clipping",
    "opt": "optimizer step",
}


def _where(place: tuple) -> str:
    phase = _PHASES.get(place[0], place[0])
    if len(place) == 3:
        return f"{phase}, {place[2]} block of {place[1]}"
    return phase if place[0] == "start" else f"{phase}, outside the blocks"


def _adjusted(
    m: Measure, fw_extra: int, bw_extra: int, resident: dict[str, int]
) -> dict[tuple, dict[str, int]]:
    """Places with the GPU overlap allowance (buffers) and other experts' resident state."""
    out = {}
    for place, parts in m.places.items():
        p = dict(parts)
        extra = fw_extra if place[0] == "fw" else bw_extra if place[0] == "bw" else 0
        p["buffers"] += extra
        for part, value in resident.items():
            p[part] += value
        p["total"] += extra + sum(resident.values())
        out[place] = p
    return out


def _peak(places: dict[tuple, dict[str, int]]) -> tuple[tuple, dict[str, int]]:
    return max(places.items(), key=lambda kv: kv[1]["total"])


def _layout_plan(
    req: PlanRequest, u: int, r: int, ckpt: bool, train: Measure, rollout: Measure, extras: tuple[int, int]
) -> LayoutPlan:
    start = train.places.get(("start",), dict.fromkeys(PARTS, 0))
    resident = {k: (req.spec.experts - 1) * start[k] for k in ("parameters", "optimizer")}
    limit = (req.hardware.memory_gib - req.reserve) * GIB
    pieces, update_held = train.pieces, False
    if req.rl is not None and train.held_update is not None:  # update.gather_params: auto = where it fits
        _, held_parts = _peak(_adjusted(train.held_update, *extras, resident))
        update_held = req.rl.update_gather == "always" or (
            req.rl.update_gather == "auto" and held_parts["total"] <= limit
        )
        train = train.held_update if update_held else train
    adjusted = _adjusted(train, *extras, resident)
    place, parts = _peak(adjusted)
    _, rollout_parts = _peak(_adjusted(rollout, extras[0], extras[0], resident))
    comm = {"sp": 0.0, "fsdp": 0.0, "other": 0.0}
    for (kind, _), nbytes in train.comm.items():
        comm[kind] += nbytes
    step = step_seconds(req.hardware, req.dtype, train.flops, train.comm)
    dp = req.gpus // (u * r)
    iteration = {}
    if req.rl is not None:
        held_rollout, rollout_parts, held_peak = _rollout_hold(req, rollout, resident, extras, limit)
        iteration = _iteration(req, u * r, pieces, rollout, step, held_rollout, update_held)
        iteration["rollout_peak_bytes_held"] = held_peak
    return LayoutPlan(
        u,
        r,
        dp,
        ckpt,
        peak_bytes=parts["total"],
        parts={k: parts[k] for k in PARTS},
        where=_where(place),
        start_bytes=adjusted[("start",)]["total"] if ("start",) in adjusted else 0,
        rollout_peak_bytes=rollout_parts["total"],
        flops=train.flops,
        comm_bytes=comm,
        step=step,
        samples_per_second=dp * req.work.batch / step["total"] if step["total"] > 0 else 0.0,
        fits=parts["total"] <= limit and rollout_parts["total"] <= limit,
        iteration=iteration,
    )


def _rollout_hold(
    req: PlanRequest, rollout: Measure, resident: dict, extras: tuple[int, int], limit: float
) -> tuple[bool, dict[str, int], int]:
    """Whether the rollout holds its weights (``rollout.gather_params``: auto = where its peak with them fits), the
    rollout's peak parts as it then runs, and its peak with the weights held."""
    assert req.rl is not None
    _, held_parts = _peak(_adjusted(rollout, extras[0], extras[0], resident))
    held = req.rl.gather == "always" or (req.rl.gather == "auto" and held_parts["total"] <= limit)
    measure = rollout if held or rollout.per_step is None else rollout.per_step
    return held, _peak(_adjusted(measure, extras[0], extras[0], resident))[1], held_parts["total"]


def _iteration(
    req: PlanRequest,
    sp: int,
    pieces: dict,
    rollout: Measure,
    step: dict[str, float],
    held: bool,
    update_held: bool,
) -> dict[str, Any]:
    """plan --rl: the iteration's seconds by phase and ledger, images per GPU per second."""
    rl = req.rl
    assert rl is not None
    forward = step_seconds(req.hardware, req.dtype, rollout.flops, rollout.comm)
    seconds = iteration_seconds(forward, step, forward["fsdp_comm"], rl, req.work.batch, held)
    ledger = compose(Pieces(**pieces), rl, req.work.batch, held, update_held)
    by_phase: dict[str, dict[str, list[int]]] = {}
    for (phase, kind), (calls, nbytes) in sorted(ledger.items()):
        by_phase.setdefault(phase, {})[kind] = [calls, nbytes]
    return {
        "rollout_gathers_once": held,
        "update_gathers_once": update_held,
        "compile": rl.compile,
        "compile_speedup": rl.forward_speedup,
        "compile_train_speedup": rl.train_speedup,
        "seconds": seconds,
        "images_per_gpu_second": rl.samples / (sp * seconds["total"]) if seconds["total"] > 0 else 0.0,
        "ledger": by_phase,
    }


def make_plan(req: PlanRequest, progress: bool = False) -> Plan:
    """Trace every layout of ``req`` and rank them (see the module doc)."""
    _check(req)
    combos, ckpts = _combos(req), checkpointing(req)
    lists = block_lists(req.spec)
    tasks, counts = _tasks(req, lists), _counts(req, lists)
    workers = req.workers if req.workers is not None else min(4, os.cpu_count() or 1)
    results = run_all(tasks, min(workers, len(tasks)), progress)
    per = len(tasks) // (len(combos) * len(ckpts))
    extras = _allowance(req)
    plans, rollouts = [], {}
    for i, (u, r, rep, ckpt) in enumerate((*combo, c) for combo in combos for c in ckpts):
        chunk = results[i * per : (i + 1) * per]
        measured = [m for m, (_, part) in zip(chunk, counts, strict=True) if part != "ledger"]
        train = combine(lists, [m[0] for m in measured]) if req.shortcut else chunk[0][0]
        if chunk[0][1] is not None:
            rollouts[(u, r, rep)] = combine(lists, [m[1] for m in measured]) if req.shortcut else chunk[0][1]
        ledgers = [m[0].pieces for m, (_, part) in zip(chunk, counts, strict=True) if part == "ledger"]
        if ledgers:
            train.pieces = grown_pieces(lists, ledgers)
        plan = _layout_plan(req, u, r, ckpt, train, rollouts[(u, r, rep)], extras)
        plan.replicate = rep
        plans.append(plan)
    fitting = [p for p in plans if p.fits]
    if req.rl is not None:  # the iteration's throughput, not one train step's
        best = max(fitting, key=lambda p: (p.iteration["images_per_gpu_second"], -p.peak_bytes), default=None)
    else:
        best = max(fitting, key=lambda p: (p.samples_per_second, -p.peak_bytes)) if fitting else None
    return Plan(req, plans, best, _notes(req))


def _notes(req: PlanRequest) -> list[str]:
    hw = req.hardware
    notes = [
        f"memory: per-GPU peak of one FSDPEngine.train_step (forward, backward, AdamW step with its state held) "
        f"and of a rollout forward without grad; fits = both <= {hw.memory_gib:g} GiB - {req.reserve:.1f} GiB "
        "reserve (CUDA context, NCCL, cuBLAS workspace, allocator fragmentation)",
        "parameters are FSDP2-sharded over every GPU in fp32"
        + (" with bf16 compute (mixed precision), gradients reduced in fp32" if req.dtype == "bf16" else "")
        + (
            f"; LoRA rank {req.lora_rank} on to_q, to_k, to_v, to_out.0, base frozen" if req.lora_rank else ""
        ),
        f"time: FLOPs / ({hw.tflops(req.dtype):g} TFLOP/s x {hw.efficiency:g}) + SP collectives at "
        f"{hw.bandwidth:g} GB/s + FSDP collectives beyond the compute they overlap; throughput = dp x batch / step",
    ]
    if req.target == "cuda" and req.gpus > 1:
        notes.append(
            "buffers include one more block's gathered parameters (and gradients in backward) than a CPU "
            "run shows: FSDP2 overlaps the next block's all-gather with compute on a GPU"
        )
    if req.spec.experts > 1:
        notes.append(
            f"{req.spec.experts} experts: one trains per step, the others' sharded parameters and "
            "optimizer state stay resident"
        )
    if req.rl is not None:
        rl = req.rl
        notes.append(
            f"iteration (--rl): rollout = {rl.num_steps} forwards at batch {rl.samples}{' x 2 (CFG)' if rl.cfg else ''}"
            f", old log-probs = {rl.trained_steps} more, training = {rl.samples // req.work.batch} micro-batches x "
            f"{rl.trained_steps} trained steps (forward + backward); reward = the rewards' exposed time at "
            f"{rl.reward_seconds:g} s per sample on a device of their own, {rl.chunks} rollout chunk(s)"
            f"{', the update one iteration behind (--lag 1)' if rl.lag else ''} (decoding on "
            "the trainer's GPUs and the trainer's own batch and reward exchanges are not included); "
            "images/GPU/s = samples per data-parallel rank / (SP degree x iteration seconds)"
        )
        if rl.compile != "off":
            notes.append(
                f"compiled (--compile {rl.compile}{', predicted as blocks' if rl.compile == 'model' else ''}): "
                f"compute divided by {rl.forward_speedup:g} in the rollout's and the old log-probs' forwards"
                + (
                    f" (--compile-speedup; default {COMPILE_SPEEDUP:g}: FLUX.1-dev inference on one H100, 6.7 s -> "
                    "4.5 s, PyTorch devlog 'torch.compile and Diffusers', May 2026)"
                    if rl.forward_speedup == COMPILE_SPEEDUP else " (--compile-speedup)"
                )
                + f" and by {rl.train_speedup:g} in training (--compile-train-speedup"
                + ("; default 1: no published measurement" if rl.train_speedup == 1.0 else "")
                + "); communication as eager, so less of the gathers is hidden; the compile's own time is not "
                "counted; memory and the ledger are predicted as eager (what a compiled run's ledger counts: "
                "docs/benchmarks.md, 'Compiling')"
            )
    notes += list(req.spec.notes[1:] if req.spec.experts > 1 else req.spec.notes)
    return notes
