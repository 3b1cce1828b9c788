"""Failures during a `sp-diffusers train` run on real gloo ranks: each case runs the CLI's ``main`` on every rank with
its stderr captured, and returns (exit status, stderr) per case; a barrier after each proves that no rank hangs."""

from __future__ import annotations

import contextlib
import io
import os
import traceback

import torch.distributed as dist


def train_failures(rank: int, world: int, cases: list[tuple[str, list[str], dict[str, str]]]) -> dict:
    from sp_diffusers.cli import main
    from tests.workers.engine_steps import _quiet

    _quiet()
    out = {}
    for name, argv, env in cases:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                try:
                    status: int | str = main(argv)
                except Exception as exc:  # SP_DIFFUSERS_TRACEBACK=1: re-raised, as Python would print it
                    status = f"raised {type(exc).__name__}"
                    err.write(traceback.format_exc())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out[name] = (status, err.getvalue())
        dist.barrier()
    return out
