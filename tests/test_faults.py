"""Faults: a killed rank (torchrun --max-restarts) loses nothing; a crash while writing a checkpoint leaves
the previous one loadable and the partial one ignored; non-finite losses skip the step on every rank;
SP peers with different parameters are refused."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ._dist import run_distributed

ROOT = Path(__file__).resolve().parent.parent


def test_killed_rank_resumes_from_last_checkpoint_with_identical_parameters(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "examples/fault_kill_rank.py",
            "--iterations",
            "10",
            "--save-every",
            "3",
            "--kill-after",
            "5",
            "--json",
            str(report_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(report_path.read_text())
    assert r["faults_survived"] == 1 and r["killed_after_iteration"] >= 5
    assert r["resumed_from_iteration"] % 3 == 0 and r["resumed_from_iteration"] < r["killed_after_iteration"]
    assert 0 <= r["iterations_recomputed"] <= 3  # nothing beyond the checkpoint interval is lost
    assert r["metrics_iterations"] == 10
    assert r["tensors_compared"] > 100 and r["max_abs_diff_vs_uninterrupted"] == 0.0


def _engine():
    from diffusers.utils import logging as dlogging

    from sp_diffusers import FSDPEngine
    from sp_diffusers.tiny import tiny_model

    dlogging.set_verbosity(logging.ERROR)
    return FSDPEngine(tiny_model("qwenimage", num_layers=1, seed=0))


def test_crash_during_checkpoint_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from sp_diffusers.engine import checkpoint as ckpt

    engine = _engine()
    root = tmp_path / "ckpts"
    engine.save_checkpoint(root, step=1)
    saved = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)

    # 1) the process dies after the shards are written, before the checkpoint is published
    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated crash before publishing")

    monkeypatch.setattr(ckpt, "write_meta", crash)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(root, step=2)
    monkeypatch.undo()
    assert (root / ".tmp-step-00000002").exists() and not (root / "step-00000002").exists()
    assert ckpt.find_latest(root).name == "step-00000001"

    # 2) the process dies in the middle of writing the shards
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def half_save(state, checkpoint_id, **kwargs):
        real_save({"model": dict(list(state["model"].items())[:3])}, checkpoint_id=checkpoint_id, **kwargs)
        raise KeyboardInterrupt("simulated crash while writing shards")

    monkeypatch.setattr(dcp, "save", half_save)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(root, step=3)
    monkeypatch.undo()
    assert ckpt.find_latest(root).name == "step-00000001"

    # the previous checkpoint loads and restores the saved parameters exactly
    fresh = _engine()
    fresh.load_checkpoint(root)
    for n, p in fresh.model.named_parameters():
        assert torch.equal(p, saved[n]), n
    # the next successful save clears the partial folders
    fresh.save_checkpoint(root, step=4)
    assert not list(root.glob(".tmp-step-*"))
    assert ckpt.find_latest(root).name == "step-00000004"


def test_non_finite_loss_skips_everywhere_and_divergent_parameters_are_refused():
    for r in run_distributed("tests.workers.faults:non_finite_and_divergent_parameters", 2):
        assert r["skipped"] == 1.0 and not r["grad_norm_finite"]
        assert r["params_unchanged"] and r["global_step"] == 0
        assert r["next_step_taken"]
        assert r["divergent_parameters"] is not None and "parameters" in r["divergent_parameters"]


def test_a_failed_load_leaves_the_engine_as_it_was(tmp_path):
    """Corrupt shards fail inside DCP's load, a missing trainer.pt before it: either way the parameters, the
    optimizer state and the step stay exactly as they were (the load goes into copies first)."""
    from sp_diffusers.engine import CheckpointError

    engine = _engine()
    good = engine.save_checkpoint(tmp_path / "a", step=1)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.grad = torch.ones_like(p)
    engine.optimizer_step()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
    step = engine.global_step

    corrupt = tmp_path / "b" / good.name
    import shutil

    shutil.copytree(good, corrupt)
    for f in corrupt.glob("*.distcp"):
        f.write_bytes(b"garbage")
    incomplete = tmp_path / "c" / good.name
    shutil.copytree(good, incomplete)
    (incomplete / "trainer.pt").unlink()
    for path, words in ((corrupt, "corrupt or incomplete"), (incomplete, "no trainer.pt")):
        with pytest.raises(CheckpointError, match=words):
            engine.load_checkpoint(path)
        assert engine.global_step == step
        for n, p in engine.model.named_parameters():
            assert torch.equal(p, before[n]), n
        assert {id(p) for p in engine.optimizer.state} == set(moments)
        for p, s in engine.optimizer.state.items():
            for k, v in s.items():
                assert torch.equal(v, moments[id(p)][k]), k
    engine.load_checkpoint(good)  # and a good one still loads into the same engine
    assert engine.global_step == 0


def test_every_rank_agrees_before_backward():
    """Unequal dp batches are weighted by samples (fp32, |d| <= 1e-5 + 1e-4 |ref| for every gradient); a
    loss_fn raising on one rank only (after the forward) makes every rank raise within seconds; a loss_fn
    returning something other than a scalar loss with grad is refused with a message naming loss_fn; an output
    folder held by another live run is refused on every rank, and free again once that run ends; a save that
    fails on one rank (a root it cannot create, a full disk) raises the same CheckpointError on every rank and
    leaves no partial folder, ``latest`` on the previous checkpoint."""
    results = run_distributed("tests.workers.faults:step_agreement", 4)
    for rank, r in enumerate(results):
        assert r["unequal_dp_grad_excess"] <= 1e-5, r["unequal_dp_grad_excess"]
        msg = r["one_rank_fails"]
        assert msg is not None and r["one_rank_fails_seconds"] < 20, r
        if rank == 1:
            assert msg == "RuntimeError: a bug in this rank's reward"
        else:
            assert msg.startswith("StepError") and "rank 1" in msg and "a bug in this rank's reward" in msg
        assert "shape" in r["non_scalar"] and "scalar" in r["non_scalar"]
        assert "float" in r["python_float"] and "no gradient" in r["python_float"]
        assert "does not require grad" in r["no_grad"]
        assert "(loss, metrics)" in r["not_a_pair"]
        for name in ("non_scalar", "python_float", "no_grad", "not_a_pair"):
            assert "loss_fn" in r[name], name
        lock = r["run_dir_in_use"]
        assert lock is not None and "is in use by a run that is still going" in lock and "pid " in lock, lock
        assert "--out-dir" in lock and r["run_dir_free_again"]
        unwritable, full = r["save_root_unwritable"], r["save_disk_full_on_rank_1"]
        assert (
            unwritable is not None and "preparing checkpoint folder" in unwritable and "rank 0" in unwritable
        )
        assert full is not None and "writing checkpoint" in full and "No space left on device" in full, full
        assert r["partial_folders_left"] == [] and r["latest_after_failures"] == "step-00000001"


def test_resume_on_another_layout_continues_the_run(tmp_path):
    """A run preempted twice and resumed on another number of ranks: SP 2 (2 ranks) -> dp 2 x SP 2 (4 ranks) ->
    1 process. Loading reshards, so every parameter and AdamW moment a layout loads is bitwise what the other
    layout saved (pure data movement: holds on any CPU). The step taken after resuming at dp 2 x SP 2 equals
    the step one process takes from the same checkpoint: gradients within 1e-5 + 1e-4|g|, parameters within the
    bound those gradients imply through AdamW with the loaded moments (tests/_parity.py,
    ``adam_resumed_step_tolerance``)."""
    from ._parity import PARITY_EPS, PARITY_LR, adam_resumed_step_tolerance

    root = str(tmp_path)
    for phase, world in (("a", 2), ("b", 4), ("c", 1)):
        results = run_distributed("tests.workers.faults:resume_on_other_layouts", world, phase, root)
        assert [r["global_step"] for r in results] == [{"a": 2, "b": 3, "c": 3}[phase]] * world
    load = functools.partial(torch.load, weights_only=True)
    saved, loaded = load(tmp_path / "a_saved.pt"), load(tmp_path / "b_loaded.pt")
    assert sorted(saved) == sorted(loaded) and any(k.startswith("exp_avg_sq:") for k in saved)
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == [], (
        "2 ranks -> 4 ranks changed state"
    )
    b3, c_loaded3 = load(tmp_path / "b_step3.pt"), load(tmp_path / "c_loaded3.pt")
    assert [k for k in b3 if not torch.equal(b3[k], c_loaded3[k])] == [], "4 ranks -> 1 process changed state"
    ref = load(tmp_path / "c_step3.pt")
    assert all(torch.equal(ref[f"before:{k}"], saved[k]) for k in saved)  # the reference started from it too
    # parameters outside the loss's graph (the last block's text path) get no gradient and no AdamW state
    names = [k.split(":", 1)[1] for k in saved if k.startswith("exp_avg:")]
    checked = 0
    for name in names:
        before = ref[f"before:param:{name}"]
        bound = adam_resumed_step_tolerance(
            ref[f"param:{name}"],
            ref[f"grad:{name}"],
            ref[f"before:exp_avg:{name}"],
            ref[f"before:exp_avg_sq:{name}"],
            step=3,
            lr=PARITY_LR,
            eps=PARITY_EPS,
        )
        diff = (b3[f"param:{name}"] - ref[f"param:{name}"]).abs()
        assert bool((diff <= bound).all()), (
            f"{name}: step 3 off by {diff.max():.3e} ({(diff / bound).max():.2f}x)"
        )
        moved = (ref[f"param:{name}"] - before).abs().max().item()
        checked += moved > 0
    assert checked > 0.8 * len(names), "the reference step moved too few parameters to test anything"


def test_torch_compile_under_sp_matches_eager():
    """torch.compile (aot_eager) of a model under context parallelism, ulysses_sdpa and native: the compiled
    forward and backward give eager's numbers (fp32; aot_eager runs the same kernels, so 1e-6 covers only
    the reordering its graph may do). Both follow a forward under torch.inference_mode(), which must not break
    later training forwards."""
    for rank, r in enumerate(run_distributed("tests.workers.faults:compiled_under_sp", 2)):
        for backend, v in r.items():
            assert v["nonzero_grads"] > 10, v  # the comparison covers real gradients
            assert v["out_diff"] <= 1e-6 and v["grad_diff"] <= 1e-6, f"rank {rank} {backend}: {v}"
