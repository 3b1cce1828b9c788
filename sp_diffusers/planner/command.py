"""``sp-diffusers plan``: the arguments, the table and the JSON (fields documented in docs/planning.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from ..engine.compiling import COMPILE_MODES
from .hardware import GPUS, hardware
from .iteration import COMPILE_SPEEDUP, RLKnobs
from .models import BUILTIN, PlanError, resolve_model
from .planner import GIB, LayoutPlan, Plan, PlanRequest, make_plan
from .shapes import workload_from_pixels, workload_from_tokens

__all__ = ["add_arguments", "plan_to_json", "request_from_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help=f"a built-in model ({', '.join(BUILTIN)}) or a folder / config.json of a diffusers transformer",
    )
    size = p.add_argument_group("micro-batch (pixels or --tokens)")
    size.add_argument("--height", type=int, help="pixels")
    size.add_argument("--width", type=int, help="pixels")
    size.add_argument("--frames", type=int, default=None, help="video frames (video models; 4k+1 for most)")
    size.add_argument("--tokens", type=int, default=None, help="image/video tokens instead of pixel sizes")
    size.add_argument("--batch", type=int, default=1, help="samples per micro-batch per SP group (default 1)")
    size.add_argument(
        "--text-len", type=int, default=None, help="text tokens (default: the family's usual length)"
    )
    size.add_argument(
        "--condition-images", type=int, default=None,
        help="an edit's condition images a row, each at the output's size (Qwen-Image-Edit-2509 / 2511: 1 to 3, "
        "default 3; the other edit models: 1)",
    )
    gpu = p.add_argument_group("GPUs")
    gpu.add_argument("--gpus", type=int, required=True, help="number of GPUs (world size)")
    gpu.add_argument(
        "--nodes", type=int, default=1,
        help="nodes the GPUs are spread over (default 1): collectives that cross them use the inter-node bandwidth, "
        "and HSDP with a replica per node is planned too",
    )
    gpu.add_argument("--gpu", default="h100", help=f"preset: {', '.join(GPUS)} (default h100)")
    gpu.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (default: the preset's)")
    gpu.add_argument(
        "--tflops", type=float, default=None, help="peak TFLOP/s per GPU (default: the preset's)"
    )
    gpu.add_argument(
        "--bandwidth", type=float, default=None, help="GB/s per GPU inside a node (default: preset)"
    )
    gpu.add_argument("--efficiency", type=float, default=None, help="achieved fraction of peak (default 0.5)")
    gpu.add_argument("--reserve", type=float, default=None, help="GiB kept free (default 2 + 5%% of memory)")
    lay = p.add_argument_group("layout and training")
    lay.add_argument("--ulysses", type=int, default=None, help="fix the Ulysses degree (default: enumerate)")
    lay.add_argument("--ring", type=int, default=None, help="fix the ring degree (default: enumerate)")
    lay.add_argument(
        "--replicate", type=int, default=None,
        help="fix HSDP's replica groups (parallel.dp_replicate; default: 1, and one per node with --nodes)",
    )
    lay.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: full fine-tuning)")
    lay.add_argument(
        "--activation-checkpointing", choices=("on", "off", "auto"), default="auto", help="auto: plan both"
    )
    lay.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16", help="compute precision (default bf16)"
    )
    rl = p.add_argument_group("RL iteration (--rl): the trainer's keys in parentheses")
    rl.add_argument("--rl", action="store_true", help="plan a FlowGRPO iteration, not one train step")
    rl.add_argument(
        "--num-steps", type=int, default=16, help="denoising steps per rollout (flowgrpo.num_steps)"
    )
    rl.add_argument(
        "--cfg-scale", type=float, default=1.0, help="> 1: classifier-free guidance (flowgrpo.cfg_scale)"
    )
    rl.add_argument(
        "--trained-steps", type=int, default=2, help="SDE steps trained per sample (flowgrpo.window_size)"
    )
    rl.add_argument("--group-size", type=int, default=16, help="samples per prompt (flowgrpo.group_size)")
    rl.add_argument(
        "--prompts-per-rank",
        type=int,
        default=1,
        help="prompts per data-parallel rank (flowgrpo.prompts_per_rank)",
    )
    rl.add_argument(
        "--gather",
        choices=("auto", "always", "never"),
        default="auto",
        help="rollout weights gathered once (always), per step (never), or once where they fit (auto; "
        "rollout.gather_params)",
    )
    rl.add_argument(
        "--update-gather", choices=("auto", "always", "never"), default="never",
        help="the update's weights gathered once per optimizer step (always), per block (never), or once where "
        "they fit (auto; update.gather_params)",
    )
    rl.add_argument("--kl", action="store_true", help="a KL reference forward per trained step (LoRA)")
    rl.add_argument(
        "--reward-seconds", type=float, default=0.0,
        help="seconds a reward (decoding and scoring, on a device of its own: a reward server) takes per sample",
    )
    rl.add_argument(
        "--chunks", type=int, default=1,
        help="the rollout in N chunks, each scored while the next samples (rollout.chunks)",
    )
    rl.add_argument(
        "--lag", type=int, default=0, choices=(0, 1),
        help="1: each iteration trains the previous one's rollout while this one's is scored (update.lag)",
    )
    rl.add_argument(
        "--compile", choices=COMPILE_MODES, default="off",
        help="predict a compiled run (train.compile; default off, the trainer's): compute divided by the speedups "
        "below, communication unchanged; model is predicted as blocks (FSDP2's per-block hooks split its graph)",
    )
    rl.add_argument(
        "--compile-speedup", type=float, default=None, metavar="F",
        help=f"with --compile: what divides the compute of the forwards without grad (rollout, old log-probs); "
        f"default {COMPILE_SPEEDUP:g}, FLUX.1-dev inference on one H100 (6.7 s -> 4.5 s, compiled whole or by "
        "blocks) in the PyTorch devlog 'torch.compile and Diffusers: A Hands-On Guide to Peak Performance' "
        "(May 2026)",
    )
    rl.add_argument(
        "--compile-train-speedup", type=float, default=None, metavar="F",
        help="with --compile: what divides the compute of a training micro-step (forward and backward); default 1 "
        "(no published measurement of a compiled DiT training step: set it from your own run)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument(
        "--workers", type=int, default=None, help="processes tracing in parallel (default: CPU cores, <= 4)"
    )
    out.add_argument(
        "--target", choices=("cuda", "cpu"), default="cuda", help="cpu: predict CPU (gloo) processes"
    )


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    spec = resolve_model(args.model)
    images = args.condition_images
    if images is not None:
        if spec.condition != "edit" or not 1 <= images <= spec.max_condition_images:
            takes = (
                f"takes 1 to {spec.max_condition_images}" if spec.max_condition_images > 1
                else "takes one condition image" if spec.condition == "edit" else "is not an edit model"
            )
            raise PlanError(
                f"--condition-images {images}: {spec.name} {takes}; fix: "
                + (f"a count in 1..{spec.max_condition_images}" if spec.condition == "edit" else "leave it out")
            )
        spec = dataclasses.replace(spec, condition_images=images)
    if args.tokens is not None:
        if args.height is not None or args.width is not None:
            raise PlanError("give either --tokens or --height/--width, not both")
        work = workload_from_tokens(spec, args.tokens, args.batch, args.text_len)
    else:
        if args.height is None or args.width is None:
            h, w, f = spec.default_size
            hint = f"--height {h} --width {w}" + (f" --frames {f}" if spec.family.video else "")
            raise PlanError(f"--height and --width (or --tokens) are needed; e.g. {hint}")
        frames = (
            args.frames if args.frames is not None else (spec.default_size[2] if spec.family.video else 1)
        )
        work = workload_from_pixels(spec, args.height, args.width, frames, args.batch, args.text_len)
    nodes = args.nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or args.gpus % nodes:
        raise PlanError(f"--nodes {nodes!r} is invalid: a positive integer that divides --gpus {args.gpus}")
    hw = hardware(
        args.gpu, args.gpu_memory, args.tflops, args.bandwidth, args.efficiency,
        gpus_per_node=args.gpus // nodes if nodes > 1 else None,
    )
    return PlanRequest(
        spec,
        work,
        args.gpus,
        hw,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        ulysses=args.ulysses,
        ring=args.ring,
        checkpointing=args.activation_checkpointing,
        reserve_gib=args.reserve,
        target=args.target,
        workers=args.workers,
        rl=_rl_knobs(args),
        nodes=nodes,
        replicate=args.replicate,
    )


def _rl_knobs(args: argparse.Namespace) -> RLKnobs | None:
    compile_mode = getattr(args, "compile", "off")
    speedups = {
        "--compile-speedup": getattr(args, "compile_speedup", None),
        "--compile-train-speedup": getattr(args, "compile_train_speedup", None),
    }
    given = [name for name, value in speedups.items() if value is not None]
    if not getattr(args, "rl", False):
        if compile_mode != "off" or given:
            flag = f"--compile {compile_mode}" if compile_mode != "off" else given[0]
            raise PlanError(f"{flag} predicts the RL iteration; fix: add --rl, or leave it out")
        return None
    if given and compile_mode == "off":
        raise PlanError(
            f"{given[0]} {speedups[given[0]]:g} applies to a compiled run; fix: add --compile blocks, or leave it out"
        )
    if not args.cfg_scale >= 1.0:
        raise PlanError(f"--cfg-scale {args.cfg_scale} is invalid: >= 1 (1: no CFG)")
    forward, train = speedups.values()
    return RLKnobs(
        num_steps=args.num_steps,
        cfg=args.cfg_scale > 1.0,
        trained_steps=args.trained_steps,
        group_size=args.group_size,
        prompts_per_rank=args.prompts_per_rank,
        gather=args.gather,
        update_gather=args.update_gather,
        kl=args.kl,
        reward_seconds=args.reward_seconds,
        chunks=args.chunks,
        lag=args.lag,
        compile=compile_mode,
        compile_speedup=COMPILE_SPEEDUP if forward is None else forward,
        compile_train_speedup=1.0 if train is None else train,
    )


def selection(p: LayoutPlan, req: PlanRequest) -> dict[str, Any]:
    """The engine arguments and config keys that select layout ``p``."""
    engine = {
        "ulysses_sequence_parallel_size": p.ulysses,
        "ring_degree": p.ring,
        "activation_checkpointing": p.activation_checkpointing,
        "mixed_precision": "bf16" if req.dtype == "bf16" else None,
    }
    keys = {
        "parallel.ulysses_sequence_parallel_size": p.ulysses,
        "parallel.ring_degree": p.ring,
        "parallel.activation_checkpointing": p.activation_checkpointing,
        "parallel.mixed_precision": "bf16" if req.dtype == "bf16" else "",
    }
    if req.lora_rank:
        engine["lora"] = f"LoraSettings(rank={req.lora_rank})"
        keys.update({"lora.enabled": True, "lora.rank": req.lora_rank})
    if req.rl is not None and p.iteration:
        keys["rollout.gather_params"] = "always" if p.iteration["rollout_gathers_once"] else "never"
        keys["update.gather_params"] = "always" if p.iteration["update_gathers_once"] else "never"
        if req.rl.compile != "off":
            keys["train.compile"] = req.rl.compile
        if req.rl.lag:
            keys["update.lag"] = req.rl.lag
    verl = {
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": p.ulysses,
        "actor_rollout_ref.model.ring_degree": p.ring,
    }
    if p.replicate > 1:  # HSDP: verl names the shard group's size
        engine["dp_replicate"] = p.replicate
        keys["parallel.dp_replicate"] = p.replicate
        verl["actor_rollout_ref.actor.fsdp_config.fsdp_size"] = req.gpus // p.replicate
    return {"engine_arguments": engine, "config_keys": keys, "verl_keys": verl}


def plan_to_json(plan: Plan, seconds: float) -> dict[str, Any]:
    req = plan.request
    hw = req.hardware
    best = plan.recommended
    return {
        "model": {
            "name": req.spec.name,
            "class": req.spec.class_name,
            "source": req.spec.source,
            "experts": req.spec.experts,
        },
        "workload": {
            "tokens": req.work.tokens,
            "grid": list(req.work.grid),
            "text_tokens": req.work.text_len,
            "batch": req.work.batch,
            "pixels": list(req.work.pixels) if req.work.pixels else None,
            "description": req.work.describe(req.spec),
        },
        "training": {"lora_rank": req.lora_rank, "dtype": req.dtype, "target": req.target},
        "gpus": req.gpus,
        "nodes": req.nodes,
        "hardware": {
            "name": hw.name,
            "memory_gib": hw.memory_gib,
            "reserve_gib": req.reserve,
            "tflops": hw.tflops(req.dtype),
            "efficiency": hw.efficiency,
            "bandwidth_gb_s": hw.bandwidth,
            "inter_node_bandwidth_gb_s": hw.inter_node_bandwidth,
        },
        "layouts": [p.to_json() for p in plan.layouts],
        "recommended": None if best is None else {**best.to_json(), **selection(best, req)},
        "notes": plan.notes,
        "planner_seconds": round(seconds, 1),
    }


def _gib(n: float) -> str:
    return f"{n / GIB:7.1f}"


def print_table(plan: Plan, seconds: float, file: Any = None) -> None:
    req, hw = plan.request, plan.request.hardware
    out = file or sys.stdout
    training = f"LoRA rank {req.lora_rank}" if req.lora_rank else "full fine-tuning"
    print(
        f"sp-diffusers plan: {req.spec.name} ({req.spec.class_name}; {req.spec.source}), {training}, {req.dtype}",
        file=out,
    )
    print(f"  micro-batch: {req.work.describe(req.spec)}", file=out)
    usable = hw.memory_gib - req.reserve
    print(
        f"  GPUs: {req.gpus} x {hw.name}: {hw.memory_gib:g} GiB, {usable:.1f} usable ({req.reserve:.1f} GiB reserve)"
        + (f", {req.nodes} nodes of {hw.gpus_per_node} ({hw.inter_node_bandwidth:g} GB/s between them)" if req.nodes > 1 else ""),
        file=out,
    )
    print(file=out)
    if req.rl is not None:
        print_iterations(plan, out)
    head = " ulysses ring  dp rep ckpt |  peak GiB  params   grads   optim   activ buffers | rollout |  fits | step s samples/s"
    print(head, file=out)
    print("-" * len(head), file=out)
    for p in sorted(plan.layouts, key=lambda p: (not p.fits, -p.samples_per_second)):
        parts = "".join(
            _gib(p.parts[k]) + " " for k in ("parameters", "gradients", "optimizer", "activations")
        )
        print(
            f" {p.ulysses:7d} {p.ring:4d} {p.dp:3d} {p.replicate:3d} {'on ' if p.activation_checkpointing else 'off'}  |"
            f"   {_gib(p.peak_bytes)} {parts}{_gib(p.parts['buffers'])} | {_gib(p.rollout_peak_bytes)} |"
            f" {'  yes' if p.fits else '   no'} | {p.step['total']:6.2f} {p.samples_per_second:9.3f}",
            file=out,
        )
    print(file=out)
    best = plan.recommended
    if best is None:
        print(
            "recommended: none fits; fix: more GPUs, LoRA (--lora-rank), a smaller micro-batch, or a larger GPU",
            file=out,
        )
    else:
        sel = selection(best, req)
        ckpt = "on" if best.activation_checkpointing else "off"
        print(
            f"recommended: ulysses={best.ulysses} ring={best.ring} dp={best.dp}"
            + (f" (HSDP: {best.replicate} replicas)" if best.replicate > 1 else "")
            + f" activation checkpointing {ckpt}: "
            f"peak {best.peak_bytes / GIB:.1f} GiB ({best.where}), step {best.step['total']:.2f} s, "
            f"{best.samples_per_second:.3f} samples/s",
            file=out,
        )
        engine = ", ".join(
            f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in sel["engine_arguments"].items()
        )
        print(f"  FSDPEngine(model, {engine})", file=out)
        print(
            "  sp-diffusers train: "
            + " ".join(f"--set {k}={_yaml(v)}" for k, v in sel["config_keys"].items()),
            file=out,
        )
        print("  verl: " + " ".join(f"{k}={v}" for k, v in sel["verl_keys"].items()), file=out)
    print("\nthese are predictions, with these assumptions:", file=out)
    for note in plan.notes:
        print(f"  - {note}", file=out)
    print(f"({len(plan.layouts)} layouts traced in {seconds:.0f} s)", file=out)


def print_iterations(plan: Plan, out: Any) -> None:
    """plan --rl: each layout's iteration - seconds by phase, images per GPU per second, GB moved per kind."""
    rl = plan.request.rl
    assert rl is not None
    print(
        f"  RL iteration: {rl.samples} samples per data-parallel rank ({rl.prompts_per_rank} prompts x group "
        f"{rl.group_size}), {rl.num_steps} steps{' with CFG in one forward' if rl.cfg else ''}, {rl.trained_steps} "
        f"trained per sample, micro-batch {plan.request.work.batch}",
        file=out,
    )
    if rl.compile != "off":
        print(
            f"  compiled (train.compile: {rl.compile}{', predicted as blocks' if rl.compile == 'model' else ''}): "
            f"compute / {rl.forward_speedup:g} in the forwards without grad, / {rl.train_speedup:g} in training "
            "(assumed factors, not measured here); communication as eager",
            file=out,
        )
    head = (
        " ulysses ring  dp rep ckpt | once upd | rollout s  old s reward s  train s   iter s | img/GPU/s |"
        " gather GB reduce GB activ GB"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for p in sorted(plan.layouts, key=lambda p: (not p.fits, -p.iteration["images_per_gpu_second"])):
        it, sec = p.iteration, p.iteration["seconds"]
        moved = {k: sum(v.get(k, [0, 0])[1] for v in it["ledger"].values()) / 1e9 for k in _KINDS}
        print(
            f" {p.ulysses:7d} {p.ring:4d} {p.dp:3d} {p.replicate:3d} {'on ' if p.activation_checkpointing else 'off'}  |"
            f" {'yes ' if it['rollout_gathers_once'] else ' no '} {'yes' if it['update_gathers_once'] else ' no'} | {sec['rollout']:9.2f} {sec['old_log_probs']:6.2f}"
            f" {sec['reward']:8.2f} {sec['train']:8.2f} {sec['total']:8.2f} | {it['images_per_gpu_second']:9.3f} |"
            f" {moved['param_gather']:9.2f} {moved['grad_reduce']:9.2f} {moved['activation']:8.2f}"
            + ("" if p.fits else "  (does not fit)"),
            file=out,
        )
    print(
        "  (GB: what one GPU sends per iteration, as the trainer's ledger counts it; the per-phase ledger: --json)\n",
        file=out,
    )


_KINDS = ("param_gather", "grad_reduce", "activation")


def _yaml(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def run(args: argparse.Namespace) -> int:
    req = request_from_args(args)
    t0 = time.perf_counter()
    plan = make_plan(req, progress=sys.stderr.isatty())
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps(plan_to_json(plan, seconds), indent=2))
    else:
        print_table(plan, seconds)
    return 0
