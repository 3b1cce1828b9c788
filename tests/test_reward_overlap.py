"""rollout.chunks: each chunk's rewards are scored in a background thread while the next chunk samples.

One process trains the tiny default model with a reward that takes 0.4 s a call and notes when it ran; a forward
pre-hook on the transformer notes when each forward started. A forward that starts while the first chunk's reward
runs is the overlap itself (serial scoring would leave none there). The exactness of a chunked rollout is held by
tests/test_rollout_chunks.py (one process, the noise) and tests/test_engine.py (SP 2, the trainer's rollout).
"""

from __future__ import annotations

import threading
import time

import torch

CALLS: list[tuple[str, float, float, int]] = []


def sleepy(latents: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    start = time.monotonic()
    time.sleep(0.4)
    CALLS.append((threading.current_thread().name, start, time.monotonic(), latents.shape[0]))
    return latents.float().flatten(1).mean(dim=1)


def _trainer(chunks: int):
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.overrides = {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1  # one process, no process group
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 4, 1, [0, 1]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 2, 2, 2
    c.flowgrpo.rewards = [{"fn": "tests.test_reward_overlap:sleepy", "input": "latents"}]
    c.rollout.chunks = chunks
    c.train.progress, c.train.plot = False, False
    torch.manual_seed(0)
    return FlowGRPOTrainer(c)


def test_each_chunk_is_scored_while_the_next_samples():
    trainer = _trainer(chunks=4)
    forwards: list[float] = []
    trainer.engine.model.register_forward_pre_hook(lambda *_: forwards.append(time.monotonic()))
    CALLS.clear()
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    _, _, _, stats = trainer.collect(batch)
    assert [n for *_, n in CALLS] == [1, 1, 1, 1]  # one call per chunk, in order
    assert all(name.startswith("sp-diffusers-rewards") for name, *_ in CALLS)  # not the main thread
    _, first_start, first_end, _ = CALLS[0]
    assert any(first_start < t < first_end for t in forwards), "no forward ran while the first chunk was scored"
    # the thread's time and the main thread's wait for it (which the tiny model's fast rollout barely hides)
    assert stats["reward_seconds"] >= 4 * 0.4 and 0 < stats["reward_wait_seconds"] <= stats["reward_seconds"]


def test_a_chunk_s_failure_stops_the_iteration_with_the_reward_s_message():
    """A reward that raises in the background thread is reported as it is in one piece (rewards/scoring.py)."""
    import pytest

    from sp_diffusers.flowgrpo.rewards.scoring import RewardError

    trainer = _trainer(chunks=2)
    calls = []

    def failing(latents, prompts, metadata):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise ValueError("the reward model ran out of memory")
        return torch.zeros(latents.shape[0])

    trainer.scorer.rewards.specs[0] = trainer.scorer.rewards.specs[0].__class__(
        name="failing", ref="failing", fn=failing, input="latents"
    )
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    with pytest.raises(RewardError, match=r"reward 'failing' raised ValueError: the reward model ran out of memory"):
        trainer.collect(batch)
    assert calls == [2, 2]
