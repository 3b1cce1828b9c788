"""The DiffusionNFT variant of the main job (examples/configs/tiny_diffusion_nft_sp2.yaml), shortened for CI: two
CPU processes under torchrun, Ulysses SP = 2, and the colour reward must rise.

Shortened how: 8 iterations, 6 denoising steps, lr 1e-3 and one prompt ("a red ball", so the batch std that divides
the advantages is the samples' spread, not the spread between colours: a clean signal in few iterations). Measured
on 2 CPU cores (25 s wall): the reward goes -0.48, -0.49, -0.43, -0.36, -0.27, -0.21, -0.18, -0.14 (first two
iterations' mean -0.485, last two's -0.157: +0.33), rising every iteration after the second. The same run with
lr 0 (no learning) stays within -0.48 .. -0.51 (last two minus first two: -0.003): the batch's fresh noise moves
the mean by ~0.01. The run is deterministic (fixed seeds, gloo on CPU), so the margin asserted, +0.15, leaves room
for rounding differences between machines and is 15 times what noise alone gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/configs/tiny_diffusion_nft_sp2.yaml"
ITERATIONS = 8
MARGIN = 0.15


def test_diffusion_nft_job_reward_rises_at_sp2(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red ball\n")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "sp_diffusers.cli",
        "train",
        "--config",
        CONFIG,
        "--iterations",
        str(ITERATIONS),
        "--out-dir",
        str(out),
        "--set",
        "optim.lr=1e-3",
        "--set",
        "flowgrpo.num_steps=6",
        "--set",
        f"data.train={prompts}",
        "--set",
        "train.save_every=0",
        "--set",
        "train.progress=false",
        "--set",
        "train.plot=false",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "algorithm: diffusion_nft" in proc.stdout
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == list(range(1, ITERATIONS + 1))
    for m in lines:
        for key in (
            "reward_mean",
            "loss",
            "policy_loss",
            "old_deviate",
            "old_policy_decay",
            "grad_norm",
            "lr",
        ):
            assert key in m and m[key] == m[key], key  # present and not NaN
        assert "ppo_kl" not in m  # no ratio
    # the old policy trails the trained one: on-policy at the first update only (decay 0.001 s afterwards)
    assert lines[0]["old_deviate"] == 0.0 and lines[-1]["old_deviate"] > 0.0
    assert [m["old_policy_decay"] for m in lines] == pytest.approx(
        [0.001 * (i + 1) for i in range(ITERATIONS)]
    )
    rewards = [m["reward_mean"] for m in lines]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last - first >= MARGIN, f"the reward did not rise by {MARGIN}: {rewards}"
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{ITERATIONS:08d}"
