"""``sp-diffusers <command>`` / ``python -m sp_diffusers.cli <command>``.

Commands:
    train    FlowGRPO under FSDP2 + Ulysses SP from a YAML config (run under torchrun / accelerate launch)
    demo     tiny model, forward + backward under Ulysses SP vs one process (run under torchrun)
    report   what ``install()`` would do on this machine and diffusers version
"""

from __future__ import annotations

import argparse
import sys


def _report(_: argparse.Namespace) -> int:
    import sp_diffusers

    print(sp_diffusers.install())
    return 0


def _engine_factory(choice: str, verl_keys: bool):
    """``auto``: through verl's EngineRegistry when the run is driven by verl keys and verl is installed;
    ``verl``: always; ``native``: never."""
    import importlib.util
    import os

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


def _train(args: argparse.Namespace) -> int:
    import logging
    import os
    import warnings

    from diffusers.utils import logging as dlogging

    from .flowgrpo.config import load_config
    from .flowgrpo.trainer import FlowGRPOTrainer
    from .integrations.verl_overrides import translate_overrides

    plan = translate_overrides(list(args.overrides or []))  # verl-style hydra overrides (and our keys)
    overrides = plan.overrides + list(args.set or [])
    if args.pretrained:
        overrides.append(f"model.pretrained={args.pretrained}")
    if args.out_dir:
        overrides.append(f"train.out_dir={args.out_dir}")
    if args.iterations is not None:
        overrides.append(f"train.iterations={args.iterations}")
    config = load_config(args.config, overrides)
    plan.check_launch(int(os.environ.get("WORLD_SIZE", "1")))
    plan.check_rollout(config)
    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\..*")
    factory, engine_name = _engine_factory(args.engine, bool(plan.verl))
    trainer = FlowGRPOTrainer(config, engine_factory=factory)
    if trainer.rank == 0:
        layout = trainer.engine.layout
        print(
            f"engine: {engine_name}, ulysses_sequence_parallel_size={layout.ulysses}, ring_degree={layout.ring}",
            flush=True,
        )
        print(f"algorithm: {config.flowgrpo.algorithm}; schedule: {trainer.schedule.source}", flush=True)
    history = trainer.run()
    if trainer.rank == 0 and history:
        n = min(5, len(history))
        first = sum(m["reward_mean"] for m in history[:n]) / n
        last = sum(m["reward_mean"] for m in history[-n:]) / n
        print(
            f"reward (mean of {n} iterations): first {first:+.4f} -> last {last:+.4f}; outputs in {config.train.out_dir}"
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from . import demo

    parser = argparse.ArgumentParser(prog="sp-diffusers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser(
        "train", help="FlowGRPO training (torchrun --nproc_per_node N -m sp_diffusers.cli train ...)"
    )
    p_train.add_argument(
        "--config", default=None, help="YAML config (examples/configs/*.yaml); defaults when omitted"
    )
    p_train.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config key, repeatable"
    )
    p_train.add_argument("--pretrained", default=None, help="transformer folder written by save_pretrained")
    p_train.add_argument("--out-dir", default=None)
    p_train.add_argument("--iterations", type=int, default=None)
    p_train.add_argument(
        "--engine",
        choices=("auto", "verl", "native"),
        default="auto",
        help="build the engine through verl's EngineRegistry (auto: when verl keys are given and verl is "
        "installed) or directly",
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
    p_report = sub.add_parser("report", help="print what install() applies for the installed diffusers")
    p_report.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # verl-style KEY=VALUE overrides may come before and after options (argparse takes one positional run)
    if getattr(args, "overrides", None) is not None:
        args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if x not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
