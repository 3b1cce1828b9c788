"""Failures during a run print as configuration errors do (issue 33): one block on rank 0 with the message and the
fix, no traceback (``SP_DIFFUSERS_TRACEBACK=1`` shows it), every rank stopping with the same status.

Two gloo ranks (SP 2) train the tiny default model with a reward of the test's own that fails in one way per case:
it raises on rank 1 only, returns a wrong shape, returns NaN, or reads a field the prompt rows lack (the data); a
checkpoint that cannot be written ends the last case. Each rank runs the CLI's ``main`` with its stderr captured
(``tests/workers/run_failures.py``); one case runs under torchrun as a user runs it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._dist import run_distributed

ROOT = Path(__file__).resolve().parent.parent
REWARDS = """
import torch
import torch.distributed as dist


def rank1_fails(x, prompts, metadata):
    if dist.get_rank() == 1:
        raise ValueError("no model on this rank")
    return torch.zeros(x.shape[0])


def wide(x, prompts, metadata):
    return torch.zeros(x.shape[0], 2)


def nan(x, prompts, metadata):
    return torch.full((x.shape[0],), float("nan"))


def strict_color(x, prompts, metadata):
    return torch.tensor([float(len(row["color"])) for row in metadata])


def fine(x, prompts, metadata):
    return x.float().flatten(1).mean(dim=1)


SERVED = []
CALLS = []


def rank1_killed_in_iteration_2(x, prompts, metadata):
    import os
    import signal

    CALLS.append(1)
    if dist.get_rank() == 1 and len(CALLS) == 2:  # SIGKILL: no Python cleanup, no message of its own
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.zeros(x.shape[0])


def dies_at_its_third_request(x, prompts, metadata):
    import os

    SERVED.append(len(prompts))
    if len(SERVED) == 3:  # the reward server killed mid-run: the process is gone, mid-request
        os._exit(1)
    return [0.1 * len(SERVED)] * len(prompts)
"""


def _argv(root: Path, name: str, fn: str, *extra: str) -> list[str]:
    sets = {
        "model.overrides": "{num_layers: 1}",
        "flowgrpo.num_steps": 2,
        "flowgrpo.window_size": 1,
        "flowgrpo.window_range": "[0, 1]",
        "flowgrpo.group_size": 2,
        "flowgrpo.prompts_per_rank": 1,
        "flowgrpo.micro_batch_size": 2,
        "flowgrpo.rewards": f"[{{fn: {root / 'rewards.py'}:{fn}, input: latents}}]",
        "train.progress": "false",
        "train.plot": "false",
    }
    argv = ["train", "--out-dir", str(root / name), "--iterations", "1"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv + list(extra)


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-failures")
    (root / "rewards.py").write_text(REWARDS)
    (root / "prompts.txt").write_text("a red cat\na blue dog\n")  # a .txt file: rows without fields
    (root / "checkpoint").mkdir()
    (root / "checkpoint" / "checkpoints").write_text("a file where the checkpoints folder goes")
    # reward servers that die in the run's second iteration (2 requests an iteration): one beside a chunked
    # rollout, one beside a lagged update (update.lag: iteration 1 trains its own rollout before its checkpoint)
    ports, servers = [_free_port(), _free_port()], []
    for port in ports:
        servers.append(subprocess.Popen(
            [sys.executable, "-m", "sp_diffusers.cli", "reward-server", "--port", str(port), "--reward",
             f"{root / 'rewards.py'}:dies_at_its_third_request"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
    for port in ports:
        _wait_for(f"http://127.0.0.1:{port}/health")
    url_entries = [f"[{{url: 'http://127.0.0.1:{port}', input: latents, retries: 1, timeout: 30}}]" for port in ports]
    server_killed = _argv(root, "server_killed", "fine", "--set", f"flowgrpo.rewards={url_entries[0]}", "--set",
                          "rollout.chunks=2", "--set", "train.save_every=1", "--iterations", "2")
    server_killed_lagged = _argv(root, "server_killed_lagged", "fine", "--set", f"flowgrpo.rewards={url_entries[1]}",
                                 "--set", "update.lag=1", "--set", "train.save_every=1", "--iterations", "2")
    stale_wandb = {  # a key W&B's server refuses or cannot be asked about: here a server that is not there
        "WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_INIT_TIMEOUT": "5",
        "WANDB_MODE": "online", "WANDB_SILENT": "true", "WANDB_DIR": str(root),
    }
    cases = [
        ("server_killed", server_killed, {}),
        ("server_killed_lagged", server_killed_lagged, {}),
        ("wandb_unreachable", _argv(root, "wandb_unreachable", "fine", "--set", "train.loggers=[jsonl, wandb]"),
         stale_wandb),
        ("rank1_raises", _argv(root, "rank1_raises", "rank1_fails"), {}),
        ("wrong_shape", _argv(root, "wrong_shape", "wide"), {}),
        ("nan", _argv(root, "nan", "nan"), {}),
        ("data_field", _argv(root, "data_field", "strict_color", "--set", f"data.train={root / 'prompts.txt'}"), {}),
        ("checkpoint", _argv(root, "checkpoint", "fine"), {}),
        ("traceback", _argv(root, "traceback", "rank1_fails"), {"SP_DIFFUSERS_TRACEBACK": "1"}),
    ]
    try:
        return root, run_distributed("tests.workers.run_failures:train_failures", 2, cases, timeout=900)
    finally:
        for server in servers:
            server.kill()
            server.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str) -> None:
    import httpx

    for _ in range(300):
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"the reward server at {url} did not start")


def _block(stderr: str) -> str:
    """The one error block: its first line (the message), after checking that it is the only one, untraced."""
    lines = stderr.splitlines()
    errors = [i for i, x in enumerate(lines) if x.startswith("sp-diffusers train: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert lines[errors[0] + 1] == "(SP_DIFFUSERS_TRACEBACK=1 shows where it came from)"
    return lines[errors[0]]


@pytest.mark.parametrize(
    "case, status, words",
    [
        ("rank1_raises", 1, ["flowgrpo.rewards: on rank 1, reward 'rank1_fails'", "raised ValueError: no model on this "
                             "rank at ", "rewards.py:8; every rank stops; fix: the function at "]),
        ("wrong_shape", 1, ["on rank 0 (failing ranks: [0, 1]), reward 'wide'", "returned shape (1, 2); it must return "
                            "one float per sample: shape [1]", "fix: return one float per sample it is given"]),
        ("nan", 1, ["reward 'nan'", "returned non-finite values ([nan])", "fix: return finite scores"]),
        ("data_field", 1, ["reward 'strict_color'", "raised KeyError: 'color'", "fix: the function at ", "a key your "
                           "prompt rows lack? metadata is each data.train / data.eval row's fields other than the "
                           "prompt (a .jsonl line's; {} for a .txt file)"]),
        ("server_killed", 1, ["flowgrpo.rewards: on rank 0, reward 'http://127.0.0.1:", "reward server http://127.0.0.1:",
                              "(after 2 tries); every rank stops; fix: start it with `sp-diffusers reward-server"]),
        # the server dies at the first request for rollout 2, and the other rank's finds it gone: both fail
        ("server_killed_lagged", 1, ["flowgrpo.rewards: on rank 0 (failing ranks: [0, 1]), reward 'http://127.0.0.1:",
                                     "(after 2 tries); every rank stops; fix: start it with `sp-diffusers reward-server"]),
        ("wandb_unreachable", 2, ["train.loggers failed on rank 0", "W&B did not start (", "fix: check the network "
                                  "and the key (wandb login), or WANDB_MODE=offline"]),
        ("checkpoint", 2, ["preparing checkpoint folder ", "failed on rank 0",
                           "fix: make ", "a writable folder with free space, then run again: it resumes from the "
                           "newest checkpoint"]),
    ],
)
def test_a_run_failure_is_one_block_on_rank_0_and_every_rank_stops(failures, case, status, words):
    _, results = failures
    rank0, rank1 = results[0][case], results[1][case]
    assert rank0[0] == rank1[0] == status  # every rank stops, with one status
    line = _block(rank0[1])
    for word in words:
        assert word in line, (word, line)
    assert "error:" not in rank1[1] and "Traceback" not in rank1[1], rank1[1][-3000:]  # rank 1 stays quiet


def test_nothing_written_before_the_failure_is_lost(failures):
    root, _ = failures
    lines = (root / "checkpoint" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [1]  # the iteration trained before the save failed
    assert not (root / "rank1_raises" / "checkpoints").exists()  # no checkpoint of a run whose reward failed
    # the reward server died in iteration 2: iteration 1's row and checkpoint are kept, for the rerun to resume
    for name in ("server_killed", "server_killed_lagged"):
        lines = (root / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["iteration"] for x in lines] == [1], name
        assert [p.name for p in (root / name / "checkpoints").iterdir() if p.is_dir()] == ["step-00000001"], name
    # lagged: iteration 1 trained nothing of its own until its checkpoint drained its rollout into it
    first = json.loads((root / "server_killed_lagged" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["update_skipped"] == 1.0 and "drain/loss" in first


def test_the_traceback_is_behind_the_switch(failures):
    _, results = failures
    for rank in (0, 1):
        status, stderr = results[rank]["traceback"]
        assert status == "raised RewardError"
        assert (
            "Traceback (most recent call last)" in stderr
            and "sp_diffusers/flowgrpo/rewards/scoring.py" in stderr
        )


def test_wandb_without_a_key_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    from sp_diffusers.flowgrpo.config import ConfigError, load_config

    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError, match=r"train.loggers=.*W&B has no API key here .* fix: wandb login, or "
                       r"WANDB_MODE=offline"):
        load_config(None, ["train.loggers=[jsonl, wandb]"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    load_config(None, ["train.loggers=[jsonl, wandb]"])  # offline needs no key


def test_under_torchrun_a_reward_failing_on_one_rank_is_one_message(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "sp_diffusers.cli"]
    cmd += _argv(tmp_path, "run", "rank1_fails")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    errors = [x for x in (proc.stdout + proc.stderr).splitlines() if "sp-diffusers train: error:" in x]
    assert len(errors) == 1 and "on rank 1, reward 'rank1_fails'" in errors[0], proc.stderr[-3000:]
    # no rank printed a traceback of ours (torchrun's own report of the exit status is the launcher's)
    assert "sp_diffusers/" not in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 1" in proc.stderr  # rank 0 exited with the run-failure status, not a crash


def test_a_rank_killed_mid_run_is_one_line_naming_it_and_the_rerun_resumes(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    torchrun = Path(sys.executable).parent / "torchrun"
    # a slow monitor: torchrun would otherwise stop rank 0 as soon as it sees rank 1 gone, before rank 0 speaks
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "--monitor-interval", "10", "-m", "sp_diffusers.cli"]
    cmd += _argv(tmp_path, "run", "rank1_killed_in_iteration_2", "--set", "train.save_every=1", "--iterations", "3")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if "sp-diffusers train: error:" in x]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 1 stopped mid-run (its process is gone); this rank stops too" in errors[0], errors
    assert "the same command again resumes from the newest checkpoint in" in errors[0]
    assert "sp_diffusers/" not in proc.stderr, proc.stderr[-3000:]  # no traceback of ours
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()
