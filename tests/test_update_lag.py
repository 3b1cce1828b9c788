"""update.lag: 1 - each iteration trains the previous iteration's rollout while this one's rewards are scored in the
background (the optional one-step off-policy mode; docs/training.md, "What an iteration costs").

One process (SP 1) trains the tiny default model. What is held:

- the lagged run trains exactly the rollouts the on-policy run trains, one iteration later: at learning rate 0 the
  policy never moves, so every update's loss, gradient norm, ratio and reward statistics equal the on-policy run's
  of the iteration before, bit for bit (the drained last rollout: the on-policy run's last iteration);
- the scoring of a rollout runs while the next iteration samples (a forward starts inside the reward call);
- at a learning rate > 0 the update is one optimizer step behind its samples: the ratio moves off 1 from the
  first micro-step, the log-probs it divides by are the sampling policy's (recorded at the rollout);
- a run that saves and resumes equals one that does not (a checkpoint drains the pending rollout first);
- configurations it cannot train are refused, naming the key.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError

CALLS: list[tuple[str, float, float]] = []
SLEEP = 0.3


def sleepy(latents: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    start = time.monotonic()
    time.sleep(SLEEP)
    CALLS.append((threading.current_thread().name, start, time.monotonic()))
    return latents.float().flatten(1).mean(dim=1)


def _config(lag: int, lr: float = 0.0, out_dir: str = "", iterations: int = 4, save_every: int = 0, reward=None):
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    c.model.overrides = {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1  # one process, no process group
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 4, 2, [0, 2]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 2, 2, 2
    c.flowgrpo.drop_zero_advantage = False
    if reward is not None:
        c.flowgrpo.rewards = [{"fn": reward, "input": "latents"}]
    c.update.lag = lag
    c.optim.lr = lr
    c.train.iterations, c.train.save_every = iterations, save_every
    c.train.progress, c.train.plot, c.train.loggers = False, False, ["jsonl"]
    if out_dir:
        c.train.out_dir = out_dir
    return c


def _trainer(config):
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    torch.manual_seed(0)
    return FlowGRPOTrainer(config)


COMPARED = ("loss", "policy_loss", "grad_norm", "ratio_mean", "clipfrac", "trained_samples", "reward_mean", "reward_std")


def test_the_lagged_run_trains_the_on_policy_run_s_rollouts_one_iteration_later():
    on, lagged = _trainer(_config(lag=0)), _trainer(_config(lag=1))
    expected = [on.train_iteration(i) for i in range(3)]
    got = [lagged.train_iteration(i, drain=i == 2) for i in range(3)]
    assert got[0]["update_skipped"] == 1.0 and "loss" not in got[0]  # nothing sampled before the first
    for i in (1, 2):
        assert {k: got[i][k] for k in COMPARED} == {k: expected[i - 1][k] for k in COMPARED}, i
    assert {k: got[2][f"drain/{k}"] for k in COMPARED} == {k: expected[2][k] for k in COMPARED}
    assert lagged.pending is None  # drained
    assert expected[0]["ratio_mean"] == 1.0  # lr 0: on-policy in both


def test_a_rollout_is_scored_while_the_next_iteration_samples():
    trainer = _trainer(_config(lag=1, reward="tests.test_update_lag:sleepy"))
    forwards: list[float] = []
    trainer.engine.model.register_forward_pre_hook(lambda *_: forwards.append(time.monotonic()))
    CALLS.clear()
    trainer.train_iteration(0)
    first = trainer.train_iteration(1)
    second = trainer.train_iteration(2, drain=True)
    assert len(CALLS) == 3 and all(name.startswith("sp-diffusers-rewards") for name, *_ in CALLS)
    _, start, end = CALLS[0]
    assert any(start < t < end for t in forwards), "no forward ran while the first rollout was scored"
    # iteration 1 trains rollout 0, scored during rollout 1 and its old log-probs: a wait of less than the call
    assert first["reward_seconds"] >= SLEEP and first["reward_wait_seconds"] < first["reward_seconds"]
    assert second["drain/reward_seconds"] >= SLEEP  # the drained rollout's scoring


def test_a_positive_learning_rate_trains_one_step_behind_on_the_sampling_policy_s_log_probs():
    """One optimizer step per iteration (flowgrpo.mini_batches 1): on-policy, every forward of an update runs the
    weights that sampled, so the ratio is exactly 1; lagged, the weights moved once since, so it is not."""
    assert _config(lag=1).flowgrpo.mini_batches == 1
    on, lagged = _trainer(_config(lag=0, lr=1e-3)), _trainer(_config(lag=1, lr=1e-3))
    on_policy = [on.train_iteration(i) for i in range(2)]
    lagged.train_iteration(0)
    one = lagged.train_iteration(1)  # rollout 0 on the weights that sampled it (no update before): ratio 1
    two = lagged.train_iteration(2, drain=True)  # rollout 1, sampled before iteration 1's update
    assert on_policy[1]["ratio_mean"] == 1.0 and one["ratio_mean"] == 1.0 and one["step_skipped"] == 0.0
    assert two["ratio_mean"] != 1.0 and abs(two["ratio_mean"] - 1.0) < 0.5  # one small step behind
    assert two["drain/ratio_mean"] != 1.0  # rollout 2, sampled before iteration 2's update
    assert 0.0 <= two["clipfrac"] <= 1.0 and torch.isfinite(torch.tensor(two["loss"]))


def test_a_resumed_lagged_run_equals_the_uninterrupted_one(tmp_path):
    whole = _trainer(_config(lag=1, lr=1e-3, out_dir=str(tmp_path / "whole"), iterations=4, save_every=2))
    whole.run()
    _trainer(_config(lag=1, lr=1e-3, out_dir=str(tmp_path / "split"), iterations=2, save_every=2)).run()
    resumed = _trainer(_config(lag=1, lr=1e-3, out_dir=str(tmp_path / "split"), iterations=4, save_every=2))
    resumed.run()
    for a, b in zip(whole.engine.model.parameters(), resumed.engine.model.parameters(), strict=True):
        assert torch.equal(a, b)
    lines = [
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("whole", "split")
    ]
    keep = ("loss", "reward_mean", "drain/loss", "update_skipped")
    assert [{k: m.get(k) for k in keep} for m in lines[0]] == [{k: m.get(k) for k in keep} for m in lines[1]]
    # iterations 2 (a checkpoint) and 4 (the end) drain; 1 and 3 start with nothing to train
    assert [("drain/loss" in m, m.get("update_skipped")) for m in lines[0]] == [
        (False, 1.0),
        (True, None),
        (False, 1.0),
        (True, None),
    ]


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"update.lag": 2}, r"update\.lag=2 is invalid: 0 \(on-policy\) or 1"),
        ({"update.lag": 1, "rollout.chunks": 2}, r"rollout\.chunks=2 is invalid: with update\.lag=1 it must be 1"),
        (
            {"update.lag": 1, "flowgrpo.algorithm": "diffusion_nft"},
            r"update\.lag=1: .*flowgrpo\.algorithm=diffusion_nft .*fix: update\.lag=0, or one of flow_grpo",
        ),
    ],
)
def test_what_cannot_train_lagged_is_refused_by_name(settings, match):
    from sp_diffusers.flowgrpo.build import check_algorithm
    from sp_diffusers.flowgrpo.config import validate

    c = _config(lag=0)
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    with pytest.raises(ConfigError, match=match):
        validate(c)
        check_algorithm(c)
