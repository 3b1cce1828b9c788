"""flowgrpo.kl_reward: each trained step's KL to the reference folded into its reward (R_t = R - kl_reward KL_t)
and one advantage per trained step.

The advantages equal flow_grpo's in float64: ``scripts/train_wan2_1.py`` forms ``rewards["avg"][:, None] -
kl_reward * kl`` and hands it to ``flow_grpo/stat_tracking.py`` ``PerPromptStatTracker.update`` (``_tracker`` below
restates it: per prompt the column means, ``global_std``'s population std of every row per column, + 1e-4), and clamps
each column to ``adv_clip_max`` at training. Tolerance 1e-12 (float64). The trainer's KL is held by its limits: 0
exactly where the LoRA adapters are zero (the policy is the reference), positive otherwise, and the iteration then
trains on-policy (ratio exactly 1) with one advantage per trained step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig

TOL = 1e-12


def _tracker(prompts: list[str], rewards: np.ndarray) -> np.ndarray:
    """PerPromptStatTracker(global_std=True).update(prompts, rewards) of a fresh tracker, type 'grpo'."""
    prompts_a = np.array(prompts)
    out = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts_a):
        mine = rewards[prompts_a == prompt]
        mean = np.mean(mine, axis=0, keepdims=True)
        std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        out[prompts_a == prompt] = (mine - mean) / std
    return out


@pytest.mark.parametrize("coef", [0.0, 0.1, 50.0])
@pytest.mark.parametrize("equal_rewards", [False, True])
def test_per_step_advantages_equal_flow_grpo_s(coef, equal_rewards):
    from sp_diffusers.flowgrpo.algorithms.flow_grpo import FlowGRPO

    c = TrainConfig()
    c.flowgrpo.kl_reward = coef
    algorithm = FlowGRPO(c)
    g = torch.Generator().manual_seed(int(coef * 10) + equal_rewards)
    groups = torch.arange(4).repeat_interleave(3)  # 4 prompts x 3 samples
    rewards = torch.zeros(12, dtype=torch.float64) if equal_rewards else torch.randn(12, generator=g, dtype=torch.float64)
    kl = torch.rand(12, 5, generator=g, dtype=torch.float64) * 1e-2
    ours = algorithm.step_advantages(rewards, kl, groups)
    prompts = [f"p{int(i)}" for i in groups]
    theirs = _tracker(prompts, (rewards[:, None] - coef * kl).numpy())
    theirs = np.clip(theirs, -c.flowgrpo.adv_clip_max, c.flowgrpo.adv_clip_max)  # at training, per column
    assert ours.shape == (12, 5)
    np.testing.assert_allclose(ours.numpy(), theirs, atol=TOL, rtol=0)
    if coef == 0.0:  # no KL: every column is the plain advantage
        plain = algorithm.advantages(rewards, groups)
        assert torch.equal(ours, plain[:, None].expand(12, 5))


def _trainer(lora_init):
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.overrides = {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1
    c.lora.enabled, c.lora.init = True, lora_init
    c.flowgrpo.kl_reward = 0.5
    c.flowgrpo.recompute_old_log_probs = False  # the rollout's own means (flow_grpo's: from its sampling loop)
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 4, 2, [0, 2]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 2, 2, 4
    c.train.progress, c.train.plot = False, False
    torch.manual_seed(0)
    return FlowGRPOTrainer(c)


def test_the_kl_is_zero_where_the_policy_is_the_reference_and_the_update_is_on_policy():
    for init, zero in ((True, True), (False, False)):  # True: LoRA's B = 0, the adapters change nothing
        trainer = _trainer(init)
        batch = trainer.iteration_batch(0).prepared(trainer.engine)
        traj, advantages, old, stats = trainer.collect(batch)
        assert advantages.shape == (4, 2)  # one per trained step
        if zero:
            assert stats["kl_to_reference"] == 0.0
            assert torch.equal(advantages[:, 0], advantages[:, 1])  # R_t = R at every step
        else:
            assert stats["kl_to_reference"] > 0
            assert not torch.equal(advantages[:, 0], advantages[:, 1])
        metrics = trainer.update(batch, traj, advantages, old)
        assert metrics["ratio_mean"] == 1.0 and metrics["trained_samples"] > 0


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"algorithm": "dance_grpo"}, r"flowgrpo.kl_reward=0.5: .* flowgrpo.algorithm=dance_grpo does not train on"),
        ({"per_sample_windows": True}, r"kl_reward with per_sample_windows"),
        ({"kl_reward": -1.0}, r"flowgrpo.kl_reward=-1.0 must be a finite number >= 0"),
    ],
)
def test_kl_reward_is_refused_where_it_cannot_mean_what_it_says(keys, message):
    from sp_diffusers.flowgrpo.build import check_algorithm

    c = TrainConfig()
    c.flowgrpo.kl_reward = 0.5
    for k, v in keys.items():
        setattr(c.flowgrpo, k, v)
    with pytest.raises(ConfigError, match=message):
        check_algorithm(c)


def test_the_per_step_kl_and_advantages_under_sp_equal_one_process():
    """SP 2 (gloo) against one process, the same rollout: the KL to the reference within 1e-4 relative (6 steps of
    a 2-layer model in float32; measured 3e-7) and the advantages within 1e-4 (O(0.1) here, a batch-std normalisation
    of rewards that agree to 1e-5; measured 6e-7); the update on-policy on every rank."""
    from ._dist import run_distributed

    (ref,) = run_distributed("tests.workers.engine_steps:kl_reward_collect", 1, 1)
    for r in run_distributed("tests.workers.engine_steps:kl_reward_collect", 2, 2):
        assert ref["kl"] > 0 and abs(r["kl"] - ref["kl"]) <= 1e-4 * ref["kl"], (r["kl"], ref["kl"])
        assert r["advantages"].shape == ref["advantages"].shape == (4, 2)
        assert (r["advantages"] - ref["advantages"]).abs().max() <= 1e-4
        assert r["ratio_mean"] == 1.0
