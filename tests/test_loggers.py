"""train.loggers: Weights & Biases beside metrics.jsonl, in its offline mode (no network): the run's files are
written under the run folder, its history holds every iteration's metrics as metrics.jsonl does, a resumed run
continues the same W&B run, and a logger that is not installed or not known is refused with the key."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path

import pytest

from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig, validate
from sp_diffusers.flowgrpo.io.metrics import RunLog


def _records(path: str) -> list:
    """The protobuf records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then LevelDB's log format
    (32 KiB blocks of chunks: checksum 4, length 2, type 1 - full / first / middle / last - then the data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is zero padding
            pos += room
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _history(out_dir) -> tuple[list[dict], dict]:
    """Every history row and the run's config, from the log of the one offline run in ``out_dir``; the log is
    written by W&B's own process, so it is read once its exit record is there."""
    [path] = glob.glob(str(out_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(100):
        records = _records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    rows, config = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "run":
            config.update({_key(item): json.loads(item.value_json) for item in record.run.config.update})
    return rows, config


def _log(out_dir, start: int, stop: int) -> None:
    log = RunLog(out_dir, 0, ("jsonl", "wandb"), "sp-diffusers-test")
    log.open({"flowgrpo": {"num_steps": 8}, "train": {"seed": 3}})
    for i in range(start, stop):
        log.append({"iteration": i, "reward_mean": 0.25 * i, "seconds": 1.5, "comm/rollout/param_gather_bytes": 64.0})
    log.close(plot=False)


def test_wandb_offline_writes_every_iteration_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    _log(out, 1, 4)
    rows, config = _history(out)
    assert [r["reward_mean"] for r in rows] == [0.25, 0.5, 0.75] == [
        json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["_step"] for r in rows] == [1, 2, 3]  # the iteration is W&B's step
    assert rows[0]["comm/rollout/param_gather_bytes"] == 64.0  # the ledger's keys as metrics.jsonl has them
    assert config["flowgrpo"] == {"num_steps": 8}  # the run's config
    run_id = (out / "wandb_run_id").read_text()
    time.sleep(1.1)  # W&B names a session's folder by the second it starts: two sessions, two folders
    _log(out, 4, 6)  # a restart from the checkpoint: the same W&B run
    assert (out / "wandb_run_id").read_text() == run_id
    assert len(glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}"))) == 2


def test_a_logger_that_is_not_known_or_not_installed_is_refused(monkeypatch):
    c = TrainConfig()
    c.train.loggers = ["jsonl", "mlflow"]
    with pytest.raises(ConfigError, match=r"train\.loggers=.*unknown: \['mlflow'\]"):
        validate(c)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    c.train.loggers = ["jsonl", "wandb"]
    with pytest.raises(ConfigError, match=r"wandb is not installed; fix: pip install 'sp-diffusers\[wandb\]'"):
        validate(c)
