"""The GRPO-Guard variant of the main job (examples/configs/tiny_grpo_guard_sp2.yaml), shortened for CI: two gloo
ranks at Ulysses SP 2, a full-SDE rollout, the first int(N * 0.99) steps trained with the normalised ratio.

Shortened to ~21 s on 2 cores (10 s of it the 10 iterations): 6 steps, 8 samples an iteration, lr 2e-3, and prompts
of one colour (the colour reward then asks one thing of every sample, so its mean moves at once instead of wandering
with the prompts drawn). Measured on this job (CPU, 2 cores): the mean reward of iterations 8-10 minus that of 1-3
was +0.90, +0.59 and +0.91 (train.seed 0, 1, 2); the test asks for +0.3, half the smallest. The full config, every
colour, 60 iterations: from +0.014 (mean of the first 5) to +0.377 (the last 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/configs/tiny_grpo_guard_sp2.yaml"


def test_grpo_guard_job_raises_the_reward_at_sp2(tmp_path):
    out = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "sp_diffusers.cli",
        "train",
        "--config",
        CONFIG,
        "--iterations",
        "10",
        "--out-dir",
        str(out),
        "--set",
        "flowgrpo.num_steps=6",
        "--set",
        "flowgrpo.prompts_per_rank=2",
        "--set",
        "flowgrpo.micro_batch_size=8",
        "--set",
        "optim.lr=2e-3",
        "--set",
        'prompts=["a red cat", "a red house", "a red teapot"]',
        "--set",
        "train.save_every=0",
        "--set",
        "train.plot=false",
        "--set",
        "train.progress=false",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "algorithm: grpo_guard" in proc.stdout
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == list(range(1, 11))
    for m in lines:
        for key in (
            "reward_mean",
            "loss",
            "ppo_kl",
            "approx_kl",
            "clipfrac",
            "clipfrac_gt_one",
            "ratio_mean_bias",
        ):
            assert key in m and m[key] == m[key], key  # present and not NaN
        assert m["trained_samples"] > 0
    rewards = [m["reward_mean"] for m in lines]
    rise = sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3
    assert rise > 0.3, f"the reward did not rise: {rewards}"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000010"
