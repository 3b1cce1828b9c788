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


def _train(args: argparse.Namespace) -> int:
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    from .flowgrpo.config import load_config
    from .flowgrpo.trainer import FlowGRPOTrainer

    overrides = list(args.set or [])
    if args.pretrained:
        overrides.append(f"model.pretrained={args.pretrained}")
    if args.out_dir:
        overrides.append(f"train.out_dir={args.out_dir}")
    if args.iterations is not None:
        overrides.append(f"train.iterations={args.iterations}")
    config = load_config(args.config, overrides)
    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\..*")
    trainer = FlowGRPOTrainer(config)
    history = trainer.run()
    if trainer.rank == 0 and history:
        first = sum(m["reward_mean"] for m in history[:5]) / len(history[:5])
        last = sum(m["reward_mean"] for m in history[-5:]) / len(history[-5:])
        print(
            f"reward (mean of 5 iterations): first {first:+.4f} -> last {last:+.4f}; outputs in {config.train.out_dir}"
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
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
