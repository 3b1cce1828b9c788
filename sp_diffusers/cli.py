"""The ``sp-diffusers`` command (also ``python -m sp_diffusers.cli``).

Commands: ``train`` (FlowGRPO under FSDP2 + Ulysses SP from a YAML config), ``export`` (a run's weights in
diffusers' formats), ``sample`` (render prompts under SP: PNG / MP4), ``demo`` (a tiny model's forward and backward
under SP against one process), ``plan`` (which layout fits, predicted on fake tensors, no GPU), ``report`` (what
``install()`` does with this diffusers). ``train``
and ``demo`` run under a launcher: ``torchrun --nproc_per_node 2 -m sp_diffusers.cli train ...`` or, with the
console script, ``torchrun --nproc_per_node 2 --no-python sp-diffusers train ...``.

A mistake in the command or the config prints one block, once (rank 0), and exits with status 2; the
other ranks stay quiet (``SP_DIFFUSERS_TRACEBACK=1`` re-raises it with its traceback). A failure during a run that
every rank learns together and whose message names the fix (a reward that raises or returns a wrong shape or a
non-finite score, on whichever rank) prints the same way and exits with status 1 on every rank; checkpoint and data
errors are usage errors (status 2) wherever they happen.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DESCRIPTION = (
    "Exact Ulysses sequence parallelism for diffusers transformers. Run train/demo under torchrun: "
    "'torchrun --nproc_per_node 2 -m sp_diffusers.cli train ...' (or 'torchrun --nproc_per_node 2 "
    "--no-python sp-diffusers train ...')."
)
USAGE_ERROR = 2
RUN_FAILED = 1  # the command was right; the run failed in a way its message explains (a reward)
INTERRUPTED = 130  # Ctrl-C: the shell's status for SIGINT
QUIET_RANK_WAIT = 30.0  # seconds a rank that does not report waits for rank 0's report under torchrun


def _rank() -> int:
    """This process's rank: the process group's where one is joined (also without a launcher's ``RANK``)."""
    dist = sys.modules.get("torch.distributed")  # never imports torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _report(_: argparse.Namespace) -> int:
    import sp_diffusers

    print(sp_diffusers.install())
    return 0


def _engine_factory(choice: str, verl_keys: bool):
    """``auto``: through verl's EngineRegistry when the run is driven by verl keys and verl is installed;
    ``verl``: always; ``native``: never."""
    import importlib.util

    if choice == "native" or (
        choice == "auto" and (not verl_keys or importlib.util.find_spec("verl") is None)
    ):
        return None, "sp_diffusers.FSDPEngine"
    import torch

    if "VERL_PLATFORM" not in os.environ and not torch.cuda.is_available():
        # verl 0.9.1 has no CPU platform and would fall back to "cuda"/"nccl": opt in to ours (gloo)
        os.environ["VERL_PLATFORM"] = "cpu"
    from .integrations.verl import MODEL_TYPE, fsdp_engine_via_verl

    return fsdp_engine_via_verl, f"sp_diffusers.FSDPEngine via verl EngineRegistry (model_type={MODEL_TYPE})"


def _config(args: argparse.Namespace):
    from .flowgrpo.config import load_config
    from .integrations.verl.overrides import translate_overrides

    plan = translate_overrides(list(args.overrides or []))  # verl-style hydra overrides (and our keys)
    overrides = plan.overrides + list(args.set or [])
    if args.pretrained:
        overrides.append(f"model.pretrained={args.pretrained}")
    if args.out_dir:
        overrides.append(f"train.out_dir={args.out_dir}")
    if args.iterations is not None:
        overrides.append(f"train.iterations={args.iterations}")
    if args.reset_optimizer:
        overrides.append("train.reset_optimizer=true")
    return plan, load_config(args.config, overrides)


def _train(args: argparse.Namespace) -> int:
    import logging
    import warnings

    import yaml
    from diffusers.utils import logging as dlogging

    plan, config = _config(args)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if args.check:  # the folders and files it names too, as training reads them first (no weights loaded)
        from .flowgrpo.preflight import check_config

        for line in check_config(config):
            print(line)
        print(f"config OK: {args.config or '(defaults)'} -> {config.train.out_dir}")
        return 0
    plan.check_launch(int(os.environ.get("WORLD_SIZE", "1")))
    plan.check_rollout(config)
    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\..*")
    from .flowgrpo.trainer import FlowGRPOTrainer

    factory, engine_name = _engine_factory(args.engine, bool(plan.verl))
    trainer = FlowGRPOTrainer(config, engine_factory=factory)
    if trainer.rank == 0:
        layout = trainer.engine.layout
        replicate = getattr(layout, "replicate", 1)
        print(
            f"engine: {engine_name}, ulysses_sequence_parallel_size={layout.ulysses}, ring_degree={layout.ring}"
            + (f", dp_replicate={replicate} (HSDP)" if replicate > 1 else ""),
            flush=True,
        )
        print(f"algorithm: {config.flowgrpo.algorithm}; schedule: {trainer.schedule.source}", flush=True)
    try:
        history = trainer.run()
    except Exception as err:
        from .parallel.launch import lost_peer

        lost = lost_peer(err)
        if lost is None or os.environ.get("SP_DIFFUSERS_TRACEBACK"):
            raise
        print(
            f"sp-diffusers train: error: {lost}; this rank stops too; fix: that rank's own output says why it "
            f"stopped; the same command again resumes from the newest checkpoint in {trainer.ckpt_dir}",
            file=sys.stderr,
            flush=True,
        )
        return RUN_FAILED
    trained = [m for m in history if m["iteration"] > trainer.start_iteration]
    if trainer.rank == 0 and trained:
        n = min(5, len(trained))
        # offline preference pairs score nothing: their implicit reward margin is what moves
        key, name = ("reward_mean", "reward") if "reward_mean" in trained[0] else ("implicit_reward_margin", "margin")
        first = sum(m[key] for m in trained[:n]) / n
        last = sum(m[key] for m in trained[-n:]) / n
        print(f"{name} (mean of {n} iterations): first {first:+.4f} -> last {last:+.4f}; outputs in {config.train.out_dir}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """``sp-diffusers export --run RUN_DIR --out DIR``: the run's weights in diffusers' formats (one process)."""
    from .flowgrpo.io.export import export_run

    try:
        result = export_run(
            args.run,
            args.out,
            step=args.step,
            dtype=args.dtype,
            force=args.force,
            link=args.link,
            link_as_root=args.link_as_root,
        )
    except KeyboardInterrupt:
        print(
            f"sp-diffusers export: interrupted; nothing was published: --out {args.out} is as it was (the staging "
            "folder beside it was removed)",
            file=sys.stderr,
            flush=True,
        )
        return INTERRUPTED
    for note in result.notes:
        print(note)
    for name, folder in result.transformers.items():
        print(f"{name}: {folder} (save_pretrained{', LoRA merged' if result.loras else ''})")
    for name, file in result.loras.items():
        print(f"{name} LoRA: {file} (load_lora_weights / load_lora_adapter)")
    if result.pipeline is not None:
        print(f"pipeline: {result.pipeline} (DiffusionPipeline.from_pretrained)")
        how = ", ".join(f"{n} file{'s' * (n != 1)} {_FILE_WAYS[k]}" for k, n in sorted(result.files.items()))
        print(f"the source pipeline's other files: {how or 'none'}")
        if result.files.get("link"):
            print(
                "  hard links share their inode with the source pipeline's files; both are read-only now, so a write "
                "into the export fails instead of changing the source (root ignores that: do not write into it as root)"
            )
    print(f"from checkpoint {result.step} of {args.run}" + ("; the previous export there was replaced" if result.replaced else ""))
    return 0


_FILE_WAYS = {
    "clone": "cloned copy-on-write (no shared inode)",
    "copy": "copied (no shared inode)",
    "link": "hard-linked (--link: one inode with the source, read-only)",
}


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="a training run's out_dir (config.json + checkpoints/)")
    p.add_argument(
        "--out",
        required=True,
        help="the folder to write: new, empty, or an earlier export with --force (written beside it, renamed into place)",
    )
    p.add_argument("--force", action="store_true", help="replace the export already at --out (whole; never other folders)")
    p.add_argument(
        "--link",
        action="store_true",
        help="hard-link the source pipeline's files instead of copying them (no space; made read-only, source included)",
    )
    p.add_argument(
        "--link-as-root",
        action="store_true",
        help="allow --link as root (root writes through read-only files: a write into the export changes the source)",
    )
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    p.add_argument(
        "--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="weights' dtype on disk (default fp32)"
    )
    p.set_defaults(func=_export)


def _sample(args: argparse.Namespace) -> int:
    """``sp-diffusers sample --pipeline DIR --prompt ... --out x.png|x.mp4 [--ulysses 2]``."""
    from .flowgrpo.io.sample import render

    path = render(
        args.pipeline,
        args.prompt,
        args.out,
        lora=args.lora,
        lora_2=args.lora_2,
        ulysses=args.ulysses,
        steps=args.steps,
        height=args.height,
        width=args.width,
        frames=args.frames,
        guidance=args.guidance,
        true_cfg=args.true_cfg,
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        dtype=args.dtype,
        max_sequence_length=args.max_sequence_length,
        images=args.image,
        compile=args.compile,
    )
    if path is not None:
        note = " (no MP4 writer: pip install imageio imageio-ffmpeg)" if path.suffix != Path(args.out).suffix else ""
        print(f"wrote {path}{note}")
    return 0


def _sample_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", required=True, help="a diffusers pipeline folder (e.g. what `export` wrote)")
    p.add_argument("--prompt", required=True, action="append", help="a prompt (repeat for several, tiled)")
    p.add_argument("--out", required=True, help="x.png (images) or x.mp4 / x.gif (videos)")
    p.add_argument(
        "--image",
        action="append",
        default=None,
        help="the source image of an editing or image-to-video pipeline (Qwen-Image-Edit, FLUX.1 Kontext, Wan I2V; "
        "repeat for Qwen-Image-Edit-Plus's several)",
    )
    p.add_argument("--lora", default=None, help="a LoRA .safetensors for the transformer (load_lora_weights)")
    p.add_argument("--lora-2", default=None, help="Wan2.2: a LoRA .safetensors for transformer_2")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses degree (run under torchrun with that many)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the pipeline's)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the pipeline's)")
    p.add_argument("--frames", type=int, default=None, help="video frames (Wan; default: the pipeline's)")
    p.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="guidance_scale (default: the pipeline's); Qwen-Image(-Edit) and FLUX.1 without guidance embedding: "
        "--true-cfg",
    )
    p.add_argument(
        "--true-cfg",
        type=float,
        default=None,
        help="true_cfg_scale of Qwen-Image(-Edit), FLUX.1 and Kontext: classifier-free guidance with a negative "
        "prompt (default 1: none)",
    )
    p.add_argument(
        "--negative-prompt", default=None, help="the negative prompt (with --true-cfg > 1 and none given: ' ')"
    )
    p.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (default: the pipeline's)")
    p.add_argument("--seed", type=int, default=0, help="the noise seed (the same on every rank)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the pipeline's dtype")
    p.add_argument(
        "--compile",
        default="off",
        choices=("off", "blocks", "model"),
        help="torch.compile the transformer's blocks or whole forward (as train.compile)",
    )
    p.set_defaults(func=_sample)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def _plan(args: argparse.Namespace) -> int:
    from .planner.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, demo

    parser = argparse.ArgumentParser(prog="sp-diffusers", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"sp-diffusers {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser(
        "train",
        help="FlowGRPO training under FSDP2 + Ulysses SP (run under torchrun)",
        description="FlowGRPO training. Config keys: docs/training.md (or --print-config).",
    )
    p_train.add_argument(
        "--config", default=None, help="YAML config (examples/configs/*.yaml); the defaults when omitted"
    )
    p_train.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    p_train.add_argument(
        "--pretrained",
        default=None,
        help="a transformer folder written by save_pretrained (model.pretrained)",
    )
    p_train.add_argument(
        "--out-dir", default=None, help="where metrics, the plot and checkpoints go (train.out_dir)"
    )
    p_train.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="train until this iteration (train.iterations); a rerun continues from the newest checkpoint",
    )
    p_train.add_argument(
        "--reset-optimizer",
        action="store_true",
        help="resume the newest checkpoint's weights with a fresh optimizer state and LR schedule: what lets a run "
        "start another flowgrpo.algorithm (or drop its EMA) from them (train.reset_optimizer)",
    )
    p_train.add_argument(
        "--engine",
        choices=("auto", "verl", "native"),
        default="auto",
        help="build the engine through verl's EngineRegistry (auto: when verl keys are given and verl is "
        "installed) or directly",
    )
    p_train.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit (no training)"
    )
    p_train.add_argument(
        "--check",
        action="store_true",
        help="validate the config and the folders and files it names (model.kind against model.pipeline, the "
        "components the run needs, rewards, prompt files) and exit; no weights are loaded",
    )
    p_train.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="verl-style hydra overrides, e.g. actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
    )
    p_train.set_defaults(func=_train)
    p_demo = sub.add_parser(
        "demo", help="forward+backward of a tiny model under SP vs one process (torchrun)"
    )
    demo.add_arguments(p_demo)
    p_demo.set_defaults(func=_demo)
    from .planner.command import add_arguments as plan_arguments

    p_plan = sub.add_parser(
        "plan",
        help="which (ulysses, ring, dp, checkpointing) layout fits: per-GPU memory and step time (no GPU needed)",
        description="Predicts per-GPU memory and step time of every layout from fake-tensor runs of the real "
        "model through the engine; docs/planning.md.",
    )
    plan_arguments(p_plan)
    p_plan.set_defaults(func=_plan)
    _export_arguments(
        sub.add_parser(
            "export",
            help="write a run's trained weights in diffusers' formats (transformer/, LoRA file, pipeline folder)",
            description="From a checkpoint of any layout, one process: DIR/transformer (save_pretrained, LoRA "
            "merged), DIR/pytorch_lora_weights.safetensors for LoRA runs, and with model.pipeline the whole pipeline.",
        )
    )
    _sample_arguments(
        sub.add_parser(
            "sample",
            help="render prompts with a pipeline folder (+ LoRA) under Ulysses SP: PNG, or MP4/GIF for video",
            description="Under torchrun with --ulysses N for SP (N processes), else one process.",
        )
    )
    p_serve = sub.add_parser(
        "reward-server",
        help="serve a reward function over HTTP (flowgrpo.rewards: [{url: http://host:port}] scores through it)",
        description="POST /score: {input, prompts, metadata, kwargs} -> {rewards}; GET /health. "
        "docs/rewards.md, 'A reward server'.",
    )
    p_serve.add_argument("--reward", required=True, help="pkg.module:callable or path/to/file.py:callable")
    p_serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--max-batch", type=int, default=256, help="samples per request at most (more: refused)")
    p_serve.set_defaults(func=_reward_server)
    p_report = sub.add_parser("report", help="print what install() applies for the installed diffusers")
    p_report.set_defaults(func=_report)
    return parser


def _reward_server(args: argparse.Namespace) -> int:
    from .flowgrpo.rewards.loading import load_callable
    from .flowgrpo.rewards.remote import serve

    serve(load_callable(args.reward, "--reward"), args.reward, args.host, args.port, args.max_batch)
    return 0


def _usage_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean "your command or config is wrong": shown as one block, without a traceback."""
    from .engine.checkpoint import CheckpointError
    from .flowgrpo.config import ConfigError
    from .parallel.mesh import MeshError
    from .patching.compat import UnsupportedDiffusersError

    return (ConfigError, MeshError, CheckpointError, UnsupportedDiffusersError, FileNotFoundError, ValueError)


def _run_failures() -> tuple[type[BaseException], ...]:
    """Failures during a run that every rank raises alike, with the fix in the message: one block too."""
    from .flowgrpo.rewards.scoring import RewardError

    return (RewardError,)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # verl-style KEY=VALUE overrides may come before and after options (argparse takes one positional run)
    if getattr(args, "overrides", None) is not None:
        args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if x not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except _usage_errors() + _run_failures() as err:
        if os.environ.get("SP_DIFFUSERS_TRACEBACK"):
            raise
        if _rank() == 0:  # every rank holds the same error: one block
            print(
                f"sp-diffusers {args.command}: error: {err}\n(SP_DIFFUSERS_TRACEBACK=1 shows where it came from)",
                file=sys.stderr,
                flush=True,
            )
        elif os.environ.get("TORCHELASTIC_RUN_ID"):
            # torchrun stops every rank as soon as one fails: a quiet rank that exits first could stop rank 0
            # before it printed the error. Rank 0's exit stops this wait at once.
            time.sleep(QUIET_RANK_WAIT)
        return RUN_FAILED if isinstance(err, _run_failures()) else USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
