"""The Flow-DPPO variant of the main job (examples/configs/tiny_flow_dppo_sp2.yaml), shortened for CI as the
GRPO-Guard job is: two gloo ranks at Ulysses SP 2, 6 steps, 8 samples an iteration, one-colour prompts, 10
iterations, against the same run at lr 0 (the control: what the reward does when nothing is learned).

Measured on this job (CPU, 2 cores): the mean reward of iterations 8-10 minus that of 1-3 was +0.55, +0.49 and +0.67
(train.seed 0, 1, 2) at lr 2e-3, and +0.009 at lr 0; the test asks for +0.25 (half the smallest), and the control
within 0.1 of 0. The trust region acts: 12-50% of the trained rows were masked per iteration (the second optimizer
step of an iteration is off-policy).
"""

from __future__ import annotations

from pathlib import Path

from ._jobs import train_job

CONFIG = "examples/configs/tiny_flow_dppo_sp2.yaml"


def _rise(tmp_path: Path, lr: float) -> tuple[float, list[dict]]:
    sets = {
        "flowgrpo.num_steps": 6,
        "flowgrpo.prompts_per_rank": 2,
        "flowgrpo.micro_batch_size": 8,
        "optim.lr": lr,
        "prompts": '["a red cat", "a red house", "a red teapot"]',
        "train.save_every": 0,
        "train.plot": "false",
        "train.progress": "false",
    }
    stdout, lines = train_job(CONFIG, tmp_path / f"run-{lr}", sets, iterations=10)
    assert "algorithm: flow_dppo" in stdout
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
