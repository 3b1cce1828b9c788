"""The command line a new user meets: help, version, the resolved config, and mistakes reported once.

Each run is a real process (the console script, torchrun); nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_help_and_version_read_plainly():
    helped = _run([str(BIN / "sp-diffusers"), "--help"])
    assert helped.returncode == 0 and "``" not in helped.stdout and "torchrun" in helped.stdout
    train_help = _run([str(BIN / "sp-diffusers"), "train", "--help"]).stdout
    for flag in ("--out-dir", "--iterations", "--print-config", "--check"):
        line = next(x for x in train_help.splitlines() if x.strip().startswith(flag))
        assert len(train_help.split(flag, 1)[1].split("\n  -", 1)[0].split()) > 2, (
            f"{flag} has no help: {line}"
        )
    from sp_diffusers import __version__

    assert _run([str(BIN / "sp-diffusers"), "--version"]).stdout.strip() == f"sp-diffusers {__version__}"


def test_print_config_is_the_resolved_yaml():
    out = _run(
        [
            str(BIN / "sp-diffusers"),
            "train",
            "--config",
            "examples/configs/tiny_qwenimage_sp2.yaml",
            "--set",
            "flowgrpo.group_size=8",
            "--print-config",
        ]
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["flowgrpo"]["group_size"] == 8 and config["parallel"]["ulysses_sequence_parallel_size"] == 2
    from sp_diffusers.flowgrpo.config import load_config

    assert (
        config == load_config("examples/configs/tiny_qwenimage_sp2.yaml", ["flowgrpo.group_size=8"]).to_dict()
    )


def test_a_config_mistake_in_the_main_job_is_one_message_before_torchrun():
    out = _run(["bash", "examples/run_flowgrpo_sp2.sh", "--set", "flowgrpo.grup_size=3"])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("sp-diffusers train: error:")]
    assert len(errors) == 1 and "did you mean flowgrpo.group_size" in errors[0]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
    assert len([x for x in out.stderr.splitlines() if x.strip() and not x.startswith("[setup]")]) <= 3


def test_under_torchrun_only_rank_0_reports_and_the_console_script_form_works():
    """``torchrun --no-python sp-diffusers train``: the documented torchrun form of the console script."""
    out = _run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "--no-python",
            str(BIN / "sp-diffusers"),
            "train",
            "--set",
            "train.iterations=-3",
        ]
    )
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if "sp-diffusers train: error:" in line]
    assert len(errors) == 1, out.stderr[-3000:]
    # no rank printed a traceback of ours (torchrun's own report of a failed worker is the launcher's)
    assert "sp_diffusers/" not in out.stderr, out.stderr[-3000:]
