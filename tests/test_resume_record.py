"""A checkpoint records its run's algorithm and EMA; a resume that would make it another run is refused before
anything is written, unless --reset-optimizer says to start from its weights (io/run_record.py).

One process (SP 1) trains the tiny default model for one iteration and saves; the next trainer resumes that folder.
"""

from __future__ import annotations

import json

import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError


def _config(out_dir, algorithm: str = "flow_grpo", ema: bool = False, iterations: int = 1, reset: bool = False):
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    c.model.overrides = {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1
    c.flowgrpo.algorithm, c.flowgrpo.ema = algorithm, ema
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 4, 1, [0, 1]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 1, 2, 2
    c.train.out_dir, c.train.iterations, c.train.reset_optimizer = str(out_dir), iterations, reset
    c.train.progress, c.train.plot, c.train.loggers = False, False, ["jsonl"]
    return c


def _run(config):
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    torch.manual_seed(0)
    trainer = FlowGRPOTrainer(config)
    trainer.run()
    return trainer


def test_another_algorithm_is_refused_then_started_from_the_weights_with_reset_optimizer(tmp_path, capsys):
    first = _run(_config(tmp_path))
    weights = {n: p.detach().clone() for n, p in first.engine.model.named_parameters()}
    config_json = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"flowgrpo.algorithm='grpo_guard', but the checkpoint .*step-00000001 was "
                       r"trained with 'flow_grpo'.*fix: flowgrpo.algorithm=flow_grpo to continue it, --out-dir DIR "
                       r"for a new run, or --reset-optimizer"):
        _run(_config(tmp_path, "grpo_guard", iterations=2))
    assert (tmp_path / "config.json").read_text() == config_json  # refused before anything was written
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1

    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    torch.manual_seed(0)
    second = FlowGRPOTrainer(_config(tmp_path, "grpo_guard", iterations=2, reset=True))
    second._resume()  # what run() does first: the weights loaded, the optimizer from scratch
    assert "grpo_guard starts from the weights of" in capsys.readouterr().out
    for name, p in second.engine.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
    assert second.engine.global_step == 0 and len(second.engine.optimizer.state) == 0
    assert second.engine.optimizer.param_groups[0]["lr"] == second.config.optim.lr
    second.run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    # the new checkpoint records the new algorithm: a plain rerun under it resumes without the flag
    _run(_config(tmp_path, "grpo_guard", iterations=3))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_run_without_the_ema_its_checkpoint_keeps_is_refused(tmp_path):
    _run(_config(tmp_path, ema=True))
    with pytest.raises(ConfigError, match=r"flowgrpo.ema=false, but the checkpoint .* keeps an EMA of the weights.*"
                       r"fix: flowgrpo.ema=true to continue it, or --reset-optimizer"):
        _run(_config(tmp_path, ema=False, iterations=2))
    _run(_config(tmp_path, ema=True, iterations=2))  # the same run continues
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
