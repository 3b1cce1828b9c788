"""``sp-diffusers <command>`` / ``python -m sp_diffusers.cli <command>``.

Commands:
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


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from . import demo

    parser = argparse.ArgumentParser(prog="sp-diffusers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
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
