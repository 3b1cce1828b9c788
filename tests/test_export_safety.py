"""Nothing a user already has is overwritten or corrupted by ``sp-diffusers export`` (issue 33).

Two tiny runs of one tiny Qwen-Image pipeline folder: A trains LoRA (its export has a LoRA file), B trains the whole
transformer (its export has none), so a mix of the two would show. Red-team cases: an export over an export (refused
without ``--force``; with it, replaced whole), over a folder that is not an export (refused, with or without
``--force``), killed half-way (the previous export intact, byte for byte), the replace without an atomic exchange and
a death between its two renames, and writes into the export (they never reach the source pipeline folder; with
``--link`` the shared files are read-only).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sp_diffusers.cli import main

from ._dist import run_distributed

ROOT = Path(__file__).resolve().parent.parent


def _argv(pipeline: Path, run: Path, lora: bool) -> list[str]:
    sets = {
        "model.pipeline": str(pipeline),
        "model.image_size": 8,
        "parallel.ulysses_sequence_parallel_size": 1,
        "flowgrpo.num_steps": 2,
        "flowgrpo.window_size": 1,
        "flowgrpo.window_range": "[0, 1]",
        "flowgrpo.group_size": 2,
        "flowgrpo.prompts_per_rank": 1,
        "flowgrpo.micro_batch_size": 2,
        "flowgrpo.reward": "color",
        "text.max_sequence_length": 32,
        "train.progress": "false",
        "train.plot": "false",
        "lora.enabled": str(lora).lower(),
    }
    argv = ["train", "--out-dir", str(run)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("export-safety")
    pipeline = Path(save_tiny_pipeline("qwenimage", root / "pipeline", num_layers=1))
    cases = [(name, _argv(pipeline, root / name, lora), [1]) for name, lora in (("run-a", True), ("run-b", False))]
    run_distributed("tests.workers.trainer_io:train_runs", 1, cases, timeout=900)
    return {"root": root, "pipeline": pipeline, "a": root / "run-a", "b": root / "run-b"}


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path -> sha256 (hidden staging folders beside it are not in it)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _export(capsys, run: Path, out: Path, *flags: str) -> tuple[int, str, str]:
    status = main(["export", "--run", str(run), "--out", str(out), *flags])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*"))


def test_an_export_over_an_export_needs_force_and_replaces_it_whole(capsys, runs, tmp_path):
    out = tmp_path / "export"
    assert _export(capsys, runs["a"], out)[0] == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    (out / "notes.txt").write_text("a file written into the export later")
    before = _files(out)
    status, _, err = _export(capsys, runs["b"], out)
    assert status == 2 and f"--out {out} already holds an export of {runs['a']} at step-00000001" in err
    assert "fix: --force to replace it (whole: nothing of it is kept), or --out another folder" in err
    assert _files(out) == before and _beside(out) == []
    status, printed, _ = _export(capsys, runs["b"], out, "--force")
    assert status == 0 and "the previous export there was replaced" in printed
    fresh = tmp_path / "fresh"
    assert _export(capsys, runs["b"], fresh)[0] == 0
    assert _files(out) == _files(fresh)  # exactly B's export: nothing of A's (LoRA file, notes) is left
    assert not (out / "pytorch_lora_weights.safetensors").exists() and not (out / "notes.txt").exists()
    assert json.loads((out / "sp_diffusers_export.json").read_text())["run"] == str(runs["b"])
    assert _beside(out) == []


def test_a_folder_that_is_not_an_export_is_refused_even_with_force(capsys, runs, tmp_path):
    pipeline, run = runs["pipeline"], runs["a"]
    for target in (pipeline, run):
        before = _files(target)
        status, _, err = _export(capsys, runs["b"], target, "--force")
        if target == pipeline:  # the run's own model.pipeline: refused as that first
            assert status == 2 and f"is the folder the run trains from (model.pipeline={pipeline})" in err
        else:
            assert status == 2 and f"--out {target} holds files and is not an export (no sp_diffusers_export.json)" in err
            assert "even with --force, so nothing of yours (a pipeline, a run) is overwritten; fix: --out a new folder" in err
        assert _files(target) == before and _beside(target) == []
    before = _files(pipeline)  # without --force: refused as a folder that is not an export
    status, _, err = _export(capsys, runs["b"], pipeline)
    assert status == 2 and "holds files and is not an export" in err and _files(pipeline) == before
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    status, _, err = _export(capsys, runs["b"], a_file)
    assert status == 2 and "is a file; fix: --out a new folder" in err and a_file.read_bytes() == b"x"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(capsys, runs["b"], empty)[0] == 0 and (empty / "transformer" / "config.json").is_file()


KILLER = """
import os, signal, sys
import sp_diffusers.flowgrpo.io.export as export
import sp_diffusers.flowgrpo.io.export_folder as folder

copy, count = folder.copy_file, [0]


def dying_copy(*args, **kwargs):
    count[0] += 1
    if count[0] == 3:  # the transformer and the LoRA file are written, the pipeline's files half copied
        os.kill(os.getpid(), signal.SIGKILL)
    return copy(*args, **kwargs)


folder.copy_file = export.copy_file = dying_copy
from sp_diffusers.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_an_interrupted_export_leaves_the_previous_one_intact(capsys, runs, tmp_path):
    out = tmp_path / "export"
    assert _export(capsys, runs["a"], out)[0] == 0
    before = _files(out)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", KILLER, "export", "--run", str(runs["b"]), "--out", str(out), "--force"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed half-way, as the process meant
    assert _files(out) == before  # the previous export, byte for byte
    (stage,) = _beside(out)
    assert stage.startswith(".export.partial-") and (out.parent / stage / "transformer" / "config.json").is_file()
    status, printed, _ = _export(capsys, runs["b"], out, "--force")
    assert status == 0 and f"removed {stage}, the staging folder of an interrupted export" in printed
    assert _beside(out) == [] and json.loads((out / "sp_diffusers_export.json").read_text())["run"] == str(runs["b"])


def test_without_an_atomic_exchange_a_death_between_the_renames_is_repaired(capsys, runs, tmp_path, monkeypatch):
    from sp_diffusers.flowgrpo.io import export_folder

    monkeypatch.setattr(export_folder, "_exchange", lambda a, b: False)  # a system without renameat2
    out = tmp_path / "export"
    assert _export(capsys, runs["a"], out)[0] == 0
    assert _export(capsys, runs["b"], out, "--force")[0] == 0 and _beside(out) == []
    before = _files(out)
    # a replace that died after moving the previous export aside, before renaming the new one in
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    os.rename(out, out.parent / f".export.previous-{dead.stdout.strip()}@{socket.gethostname()}.d")
    status, _, err = _export(capsys, runs["a"], out)
    assert status == 2 and "already holds an export" in err  # it is back, and is not replaced without --force
    assert f"(before that: restored the previous export {out} from .export.previous-" in err
    assert _files(out) == before and _beside(out) == []
    assert _export(capsys, runs["a"], out, "--force")[0] == 0
    assert json.loads((out / "sp_diffusers_export.json").read_text())["run"] == str(runs["a"])


def _source_files(pipeline: Path, out: Path) -> list[tuple[Path, Path]]:
    """(source, exported) pairs of the pipeline files an export takes over as they are."""
    pairs = []
    for src in sorted(pipeline.rglob("*")):
        rel = src.relative_to(pipeline)
        if src.is_file() and rel.parts[0] != "transformer":
            pairs.append((src, out / rel))
    return pairs


def test_writing_into_an_export_never_changes_the_source_pipeline(capsys, runs, tmp_path):
    pipeline = runs["pipeline"]
    source = _files(pipeline)
    out = tmp_path / "export"
    status, printed, _ = _export(capsys, runs["a"], out)
    assert status == 0 and "files copied (no shared inode)" in printed
    pairs = _source_files(pipeline, out)
    assert len(pairs) >= 6  # model_index.json, the VAE, the text encoder, the tokenizer, the scheduler
    for src, dst in pairs:
        assert os.stat(dst).st_ino != os.stat(src).st_ino and os.stat(dst).st_nlink == 1, dst
        with open(dst, "ab") as f:  # what a later save_pretrained into the export would do to it
            f.write(b"written into the export")
    assert _files(pipeline) == source  # the source pipeline folder is as it was


def test_link_is_asked_for_said_and_read_only(capsys, runs, tmp_path):
    pipeline = runs["pipeline"]
    out = tmp_path / "export"
    try:
        as_root = ("--link-as-root",) if os.geteuid() == 0 else ()  # refused as root otherwise (test below)
        status, printed, _ = _export(capsys, runs["a"], out, "--link", *as_root)
        assert status == 0 and "files hard-linked (--link: one inode with the source, read-only)" in printed
        assert "a write into the export fails instead of changing the source" in printed
        assert json.loads((out / "sp_diffusers_export.json").read_text())["files"] == "link"
        for src, dst in _source_files(pipeline, out):
            assert os.stat(dst).st_ino == os.stat(src).st_ino and os.stat(dst).st_nlink == 2, dst
            assert stat.S_IMODE(os.stat(dst).st_mode) & 0o222 == 0, dst  # no write bit: a write fails
            if os.geteuid() != 0:  # root ignores permission bits
                with pytest.raises(PermissionError):
                    open(dst, "ab")  # noqa: SIM115
        # the trained files are the export's own, writable as ever
        weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
        assert os.stat(weights).st_nlink == 1 and os.stat(weights).st_mode & stat.S_IWUSR
    finally:
        for src in pipeline.rglob("*"):  # the next tests' source is writable again
            if src.is_file():
                src.chmod(src.stat().st_mode | stat.S_IWUSR)


def test_an_export_racing_another_writer_keeps_what_is_there(capsys, runs, tmp_path, monkeypatch):
    from sp_diffusers.flowgrpo.io import export

    out = tmp_path / "export"
    write = export._write

    def raced(config, run_dir, stage, *args):  # another export publishes while this one writes
        result = write(config, run_dir, stage, *args)
        out.mkdir()
        (out / "sp_diffusers_export.json").write_text('{"run": "the other export"}')
        return result

    monkeypatch.setattr(export, "_write", raced)
    status, _, err = _export(capsys, runs["a"], out)
    assert status == 2 and f"--out {out} was written by something else while this export ran" in err
    assert _files(out) == {"sp_diffusers_export.json": hashlib.sha256(b'{"run": "the other export"}').hexdigest()}
    assert _beside(out) == []  # this export's staging folder is gone: no mix, no leftovers


def test_link_as_root_is_refused_unless_asked_for(capsys, runs, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    out = tmp_path / "export"
    status, _, err = _export(capsys, runs["a"], out, "--link")
    assert status == 2 and "--link as root: the linked files are read-only, but root writes through that" in err
    assert "fix: export without --link" in err and "--link-as-root where nothing will write" in err
    assert not out.exists() and _beside(out) == []


def test_link_across_file_systems_says_it_copied(capsys, runs, tmp_path, monkeypatch):
    import errno

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    status, printed, _ = _export(capsys, runs["a"], tmp_path / "export", "--link", "--link-as-root")
    assert status == 0
    assert "--link: " in printed and "on another file system than --out" in printed and "copied instead" in printed


def test_force_never_replaces_the_current_directory_or_the_run_s_own_pipeline(capsys, runs, tmp_path, monkeypatch):
    out = tmp_path / "export"
    assert _export(capsys, runs["b"], out)[0] == 0
    before = _files(out)
    monkeypatch.chdir(out / "transformer")  # inside it: replacing it would pull the folder from under the shell
    status, _, err = _export(capsys, runs["b"], out, "--force")
    assert status == 2 and f"--out {out} is the current directory (or holds it)" in err and "cd out of it" in err
    monkeypatch.chdir(tmp_path)
    # a run that trains from that export (model.pipeline): exporting it over its own source is refused
    run = tmp_path / "run-from-export"
    run.mkdir()
    config = json.loads((runs["b"] / "config.json").read_text())
    config["model"]["pipeline"] = str(out)
    (run / "config.json").write_text(json.dumps(config))
    status, _, err = _export(capsys, run, out, "--force")
    assert status == 2 and f"is the folder the run trains from (model.pipeline={out})" in err
    assert _files(out) == before


def test_ctrl_c_during_an_export_is_one_line_and_keeps_the_previous_export(capsys, runs, tmp_path, monkeypatch):
    from sp_diffusers.flowgrpo.io import export

    out = tmp_path / "export"
    assert _export(capsys, runs["a"], out)[0] == 0
    before = _files(out)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_write", interrupted)
    status, _, err = _export(capsys, runs["a"], out, "--force")
    assert status == 130 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("sp-diffusers export: interrupted; nothing was published")
    assert _files(out) == before and _beside(out) == []
