"""The GARDO variant of the main job (examples/configs/tiny_gardo_sp2.yaml): two gloo ranks at Ulysses SP 2, 6 steps
(5 trained), 8 samples an iteration, one-colour prompts, the latents as features, the colour reward as the main
reward and the mean-latent reward as the auxiliary one; 10 iterations, against the same run at lr 0 (the control).

The measure is the mean reward of iterations 2-10 minus that of iteration 1 (the untrained policy's rollout: the same
in both runs). Measured on this job (CPU, 2 cores) at lr 2e-3: +0.21, +0.21, +0.18, +0.18, +0.28 (train.seed 0-4),
and at lr 0 -0.005 and +0.001 (seeds 0, 1); the test asks for +0.09 (half the smallest) and the control within
0.03 of 0. (The last-3 minus first-3 measure of the other jobs is noisier here: +0.04 to +0.20 over the same seeds,
since GARDO's advantages keep the rewards' own scale.)

A run stopped at iteration 5 and resumed to 10 continues the KL fraction's state from its checkpoint: its iteration 6
moves the fraction exactly as the uninterrupted run's did (the rollout from the same weights scores the same).
"""

from __future__ import annotations

from pathlib import Path

from ._jobs import train_job

CONFIG = "examples/configs/tiny_gardo_sp2.yaml"
SETS = {
    "optim.lr": 2e-3,
    "prompts": '["a red cat", "a red house", "a red teapot"]',
    "train.save_every": 0,
    "train.plot": "false",
    "train.progress": "false",
}


def _rise(lines: list[dict]) -> float:
    rewards = [m["reward_mean"] for m in lines]
    return sum(rewards[1:]) / (len(rewards) - 1) - rewards[0]


def test_gardo_job_raises_the_reward_against_an_lr_0_control(tmp_path: Path):
    stdout, lines = train_job(CONFIG, tmp_path / "run", SETS, iterations=10)
    assert "algorithm: gardo" in stdout
    _, control = train_job(CONFIG, tmp_path / "control", {**SETS, "optim.lr": 0.0}, iterations=10)
    assert [m["iteration"] for m in lines] == list(range(1, 11))
    for m in lines:
        for key in ("loss", "kl", "clipfrac", "kl_gated_fraction", "kl_gated_samples", "kl_fraction"):
            assert key in m and m[key] == m[key], key  # present and not NaN
        assert 0.02 <= m["kl_fraction"] <= 0.2
    assert any(m["kl_gated_samples"] > 0 for m in lines), "the KL never applied to a sample"
    assert any(m["kl"] > 0 for m in lines) and any(m["reference_reset"] == 1.0 for m in lines)
    assert all(m["reference_reset"] == 0.0 and m["kl"] == 0.0 for m in control), "lr 0: the policy is its reference"
    rise, still = _rise(lines), _rise(control)
    assert rise > 0.09 and abs(still) < 0.03, (rise, still)

    # stopped at 5 (a checkpoint), resumed to 10: the fraction's history comes back with the weights
    resumed = tmp_path / "resumed"
    train_job(CONFIG, resumed, {**SETS, "train.save_every": 5}, iterations=5)
    stdout, after = train_job(CONFIG, resumed, {**SETS, "train.save_every": 5}, iterations=10)
    assert "resumed from" in stdout and after[5]["iteration"] == 6
    assert after[5]["reward_mean"] == lines[5]["reward_mean"]  # the same weights sampled the same rollout
    assert after[5]["kl_fraction"] == lines[5]["kl_fraction"], (after[5]["kl_fraction"], lines[5]["kl_fraction"])
