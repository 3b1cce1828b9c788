"""The README's main command, shortened (CI), the real-model path (save_pretrained -> --pretrained), and the
same job under `accelerate launch`. Each run asserts the artefacts a user looks at."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _check_run(out: Path, iterations: int) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == list(range(1, iterations + 1))
    for m in lines:
        for key in ("reward_mean", "loss", "ppo_kl", "clipfrac", "grad_norm", "lr"):
            assert key in m and m[key] == m[key], key  # present and not NaN
    assert (out / "metrics.png").stat().st_size > 10_000
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{iterations:08d}" and (out / "checkpoints" / latest / "meta.json").exists()
    return lines


def test_readme_main_command_shortened(tmp_path):
    out = tmp_path / "run"
    proc = _run(
        [
            "bash",
            "examples/run_flowgrpo_sp2.sh",
            "--iterations",
            "4",
            "--out-dir",
            str(out),
            "--set",
            "train.save_every=2",
        ]
    )
    _check_run(out, 4)
    assert "reward (mean of 4 iterations): first " in proc.stdout  # 4 iterations ran, not 5
    assert (out / "checkpoints" / "step-00000002" / "meta.json").exists()
    # the same command again: nothing left to train, and it says so and how to continue
    again = _run(["bash", "examples/run_flowgrpo_sp2.sh", "--iterations", "4", "--out-dir", str(out)])
    assert "nothing to train" in again.stdout and "--iterations N with N > 4" in again.stdout, again.stdout
    assert "reward (mean" not in again.stdout
    _check_run(out, 4)


def test_pretrained_path_loads_a_saved_transformer(tmp_path):
    from sp_diffusers.tiny import tiny_model

    saved = tmp_path / "transformer"
    tiny_model("qwenimage", seed=3, num_layers=2).save_pretrained(saved)
    out = tmp_path / "run"
    _run(
        [
            str(ROOT / ".venv/bin/torchrun") if (ROOT / ".venv/bin/torchrun").exists() else "torchrun",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "sp_diffusers.cli",
            "train",
            "--config",
            "examples/configs/tiny_qwenimage_sp2.yaml",
            "--pretrained",
            str(saved),
            "--iterations",
            "2",
            "--out-dir",
            str(out),
        ]
    )
    _check_run(out, 2)
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["pretrained"] == str(saved)


def test_accelerate_launch_runs_the_same_job(tmp_path):
    out = tmp_path / "run"
    accelerate = Path(sys.executable).parent / "accelerate"
    # accelerate's torchrun-based launcher is called --multi_gpu; on this CPU-only host it runs on gloo
    _run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--main_process_port",
            "29561",
            "-m",
            "sp_diffusers.cli",
            "train",
            "--config",
            "examples/configs/tiny_qwenimage_sp2.yaml",
            "--iterations",
            "2",
            "--out-dir",
            str(out),
        ]
    )
    _check_run(out, 2)
