"""``sp-diffusers train`` on two gloo ranks under torchrun, as a user runs it: the tiny jobs' tests share it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def train_job(config: str | Path, out: Path, sets: dict[str, Any], iterations: int | None = None) -> tuple[str, list[dict]]:
    """Train ``config`` with ``--set key=value`` for each of ``sets`` into ``out`` (one thread a rank); its stdout and
    ``metrics.jsonl`` rows. A failed run fails the test with the command and the tails of its output."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "sp_diffusers.cli", "train"]
    cmd += ["--config", str(config), "--out-dir", str(out)]
    if iterations is not None:
        cmd += ["--iterations", str(iterations)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
