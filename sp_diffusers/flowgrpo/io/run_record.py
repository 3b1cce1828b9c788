"""What a checkpoint records of the run that wrote it, and the resume that would quietly make it another run.

A checkpoint's ``extra`` keeps the run's ``flowgrpo.algorithm`` and whether it kept an EMA of the weights
(``flowgrpo.ema``). Resuming it under another algorithm would continue one run as another (the optimizer's moments,
the LR schedule and metrics.jsonl are the old algorithm's); resuming it without the EMA would drop the average at
the next checkpoint. Both are refused, on every rank alike, before anything is written, unless
``train.reset_optimizer`` (``sp-diffusers train --reset-optimizer``) says to start from the weights with a fresh
optimizer. Checkpoints written before the record existed carry none and resume as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["read_record", "resume_problem", "run_record"]


def run_record(config: Any) -> dict[str, Any]:
    """What a checkpoint of this run records of it (merged into its ``extra``)."""
    return {"algorithm": config.flowgrpo.algorithm, "ema": bool(config.flowgrpo.ema)}


def read_record(step_dir: Path) -> dict[str, Any]:
    """The ``extra`` a checkpoint folder keeps (``{}`` where it has no trainer state)."""
    path = Path(step_dir) / "trainer.pt"
    if not path.exists():
        return {}
    return dict(torch.load(path, weights_only=False).get("extra", {}))


def resume_problem(extra: dict[str, Any], config: Any, where: Path) -> str | None:
    """Why resuming the checkpoint ``where`` (its ``extra``) under ``config`` would change the run, or None."""
    theirs, ours = extra.get("algorithm"), config.flowgrpo.algorithm
    if theirs is not None and theirs != ours:
        return (
            f"flowgrpo.algorithm={ours!r}, but the checkpoint {where} was trained with {theirs!r}: resuming would "
            f"continue a {theirs} run as {ours} (its optimizer state, LR schedule and metrics.jsonl); fix: "
            f"flowgrpo.algorithm={theirs} to continue it, --out-dir DIR for a new run, or --reset-optimizer to start "
            f"{ours} from these weights here"
        )
    if extra.get("ema") and not config.flowgrpo.ema:
        return (
            f"flowgrpo.ema=false, but the checkpoint {where} keeps an EMA of the weights, which this run would drop "
            "at its next checkpoint; fix: flowgrpo.ema=true to continue it, or --reset-optimizer to go on without it"
        )
    return None
