"""Online Diffusion-DPO on the main job's model (examples/configs/tiny_diffusion_dpo_sp2.yaml), shortened for CI as
the Flow-DPPO job is: two gloo ranks at Ulysses SP 2, 6 steps, 4 prompts x 4 samples a rank (4 pairs), one-colour
prompts, 12 iterations, against the same run at lr 0 (the control: what the reward does when nothing is learned).

Measured on this job (CPU, 2 cores): the mean reward of iterations 10-12 minus that of 1-3 was +0.48, +0.65 and +0.54
(train.seed 0, 1, 2), and +0.007, +0.003, +0.005 at lr 0; the test asks for +0.24 (half the smallest), and the
control within 0.1 of 0. The implicit reward margin of the trained pairs turns positive (the policy explains its
chosen samples better than the reference does, relative to the rejected ones).
"""

from __future__ import annotations

from pathlib import Path

from ._jobs import train_job

CONFIG = "examples/configs/tiny_diffusion_dpo_sp2.yaml"


def _rise(tmp_path: Path, lr: float) -> tuple[float, list[dict]]:
    sets = {
        "flowgrpo.num_steps": 6,
        "optim.lr": lr,
        "prompts": '["a red cat", "a red house", "a red teapot"]',
        "train.save_every": 0,
        "train.plot": "false",
        "train.progress": "false",
    }
    stdout, lines = train_job(CONFIG, tmp_path / f"run-{lr}", sets, iterations=12)
    assert "algorithm: diffusion_dpo" in stdout
    rewards = [m["reward_mean"] for m in lines]
    return sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3, lines


def test_diffusion_dpo_job_raises_the_reward_against_an_lr_0_control(tmp_path):
    rise, lines = _rise(tmp_path, 1e-2)
    control, control_lines = _rise(tmp_path, 0.0)
    assert [m["iteration"] for m in lines] == list(range(1, 13))
    for m in lines:
        for key in ("loss", "implicit_acc", "implicit_reward_margin", "model_error", "reference_error"):
            assert key in m and m[key] == m[key], key  # present and not NaN
        assert m["trained_samples"] == 8.0  # 4 pairs a rank
        # where the time went: no old log-probs (DPO reads none); the phases add up to the iteration but for the
        # bookkeeping between them
        phases = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("phase_seconds/")}
        assert set(phases) == {"batch", "rollout", "reward", "update"}, phases
        assert 0.8 * m["seconds"] <= sum(phases.values()) <= m["seconds"]
    # the first update is on the reference itself (LoRA B = 0): every margin 0, the loss log 2
    assert abs(lines[0]["loss"] - 0.6931) < 1e-3 and lines[0]["implicit_reward_margin"] == 0.0
    assert sum(m["implicit_reward_margin"] for m in lines[-4:]) > 0
    assert all(m["implicit_reward_margin"] == 0.0 for m in control_lines)  # nothing learned: policy = reference
    assert rise > 0.24 and abs(control) < 0.1, (rise, control)
