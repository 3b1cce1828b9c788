"""The MixGRPO variant of the main job (examples/configs/tiny_mix_grpo_sp2.yaml), shortened: 20 iterations at
Ulysses SP 2 on 2 CPU processes (about 20 s on an idle 2-core machine), and the colour reward rises.

Margin: the mean reward of the last 5 iterations minus that of the first 5 was +0.35, +0.43, +0.23 and +0.28 with
train.seed 0, 1, 2 and 3 (the first 5 are at -0.19 +- 0.01 in each: the untrained model); the run is seeded, so a
change of rounding (another CPU's vector width) moves it like another seed would. 0.1 is less than half the
smallest rise measured, and 3 times the spread of the untrained model's 5-iteration mean across seeds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .test_main_job import _check_run, _run

ROOT = Path(__file__).resolve().parent.parent


def test_mix_grpo_variant_reward_rises(tmp_path):
    out = tmp_path / "run"
    proc = _run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "sp_diffusers.cli",
            "train",
            "--config",
            "examples/configs/tiny_mix_grpo_sp2.yaml",
            "--iterations",
            "20",
            "--out-dir",
            str(out),
            "--set",
            "train.progress=false",
        ]
    )
    lines = _check_run(out, 20)
    assert "algorithm: mix_grpo" in proc.stdout
    # the window: steps 0-1 for 10 iterations (mix.iters_per_group), then moved by one step
    assert [m["cur_timesteps"] for m in lines] == [0.0] * 10 + [1.0] * 10
    assert all(m["window_size"] == 2.0 and "kl_loss" in m for m in lines)
    first = sum(m["reward_mean"] for m in lines[:5]) / 5
    last = sum(m["reward_mean"] for m in lines[-5:]) / 5
    assert last - first > 0.1, f"reward did not rise: first {first:+.4f} -> last {last:+.4f}"
    config = json.loads((out / "config.json").read_text())
    assert config["flowgrpo"]["mix"]["tail_solver"] == "dpmsolver++"
