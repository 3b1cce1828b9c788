"""The Flow-DPPO variant of the main job (examples/configs/tiny_flow_dppo_sp2.yaml), shortened for CI as the
GRPO-Guard job is: two gloo ranks at Ulysses SP 2, 6 steps, 8 samples an iteration, one-colour prompts, 10
iterations, against the same run at lr 0 (the control: what the reward does when nothing is learned).

Measured on this job (CPU, 2 cores): the mean reward of iterations 8-10 minus that of 1-3 was +0.55, +0.49 and +0.67
(train.seed 0, 1, 2) at lr 2e-3, and +0.009 at lr 0; the test asks for +0.25 (half the smallest), and the control
within 0.1 of 0. The trust region acts: 12-50% of the trained rows were masked per iteration (the second optimizer
step of an iteration is off-policy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/configs/tiny_flow_dppo_sp2.yaml"


def _rise(tmp_path: Path, lr: float) -> tuple[float, list[dict]]:
    out = tmp_path / f"run-{lr}"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "sp_diffusers.cli", "train"]
    cmd += ["--config", CONFIG, "--iterations", "10", "--out-dir", str(out)]
    for key, value in {
        "flowgrpo.num_steps": 6,
        "flowgrpo.prompts_per_rank": 2,
        "flowgrpo.micro_batch_size": 8,
        "optim.lr": lr,
        "prompts": '["a red cat", "a red house", "a red teapot"]',
        "train.save_every": 0,
        "train.plot": "false",
        "train.progress": "false",
    }.items():
        cmd += ["--set", f"{key}={value}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "algorithm: flow_dppo" in proc.stdout
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in lines]
    return sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3, lines


def test_flow_dppo_job_raises_the_reward_against_an_lr_0_control(tmp_path):
    rise, lines = _rise(tmp_path, 2e-3)
    control, _ = _rise(tmp_path, 0.0)
    assert [m["iteration"] for m in lines] == list(range(1, 11))
    for m in lines:
        for key in ("loss", "ppo_kl", "clipfrac", "kl_new_old_mean", "kl_mask_fraction"):
            assert key in m and m[key] == m[key], key  # present and not NaN
    assert any(m["clipfrac"] > 0 for m in lines), "the trust region never masked a row"
    assert rise > 0.25 and abs(control) < 0.1, (rise, control)
