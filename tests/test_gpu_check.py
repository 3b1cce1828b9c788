"""``scripts/gpu_check.sh`` cannot rot: its dry mode (``--device cpu``) runs every check on gloo at toy sizes.

What the dry mode holds by itself: the demo under torchrun at world 1, Ulysses parity on 2 ranks in fp32 and
bf16 for every SDPA kernel the CPU has (math, flash; efficient and cuDNN must report a skip, not a failure),
and an engine step whose ``forward_backward`` reads nothing back to the host (``aten._local_scalar_dense``
counted by a dispatch mode, the CPU stand-in for CUDA's sync debug mode), and compiled blocks equal to eager with
both of their speedups measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_every_check():
    env = dict(os.environ, SP_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_name = {r["check"]: r for r in lines}
    assert by_name["summary"]["pass"] and not by_name["summary"]["failed"]
    assert by_name["demo/gloo/world1"]["pass"] is True
    for dtype in ("fp32", "bf16"):
        for kernel in ("math", "flash"):
            assert by_name[f"parity/op/{dtype}/{kernel}"]["pass"] is True
        for kernel in ("efficient", "cudnn"):  # no CPU kernel: a skip that says so
            row = by_name[f"parity/op/{dtype}/{kernel}"]
            assert row["pass"] is None and "no kernel" in row["detail"]
        assert by_name[f"parity/model/{dtype}/auto"]["pass"] is True
    step = next(r for name, r in by_name.items() if name.startswith("engine_step/"))
    assert step["pass"] is True and step["host_syncs_in_forward_backward"] == 0
    assert step["host_syncs_in_rest_of_step"] <= 1 and step["loss"] > 0
    compiled = next(r for name, r in by_name.items() if name.startswith("compile/"))
    assert compiled["pass"] is True and compiled["max_error"] <= 1e-4  # fp32 parity tolerance, asserted inside
    assert compiled["compile_speedup"] > 0 and compiled["compile_train_speedup"] > 0
    for r in lines[:-1]:
        assert set(r) >= {"check", "pass", "max_error", "max_memory_allocated", "seconds"}
