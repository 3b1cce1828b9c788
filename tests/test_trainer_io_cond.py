"""The image-conditioned families end to end at tiny size (the issue's done-when), as ``test_trainer_io.py`` holds the
text-conditioned ones: a pipeline folder of each (FLUX.1 Kontext, Qwen-Image-Edit, Qwen-Image-Edit-Plus on rows of 1,
2 and 3 images, Wan2.1 I2V, Wan2.2 I2V-A14B with both experts, Wan2.2 TI2V-5B) -> ``sp-diffusers train`` at Ulysses SP = 2 on a .jsonl of rows that name a source
image (relative paths), with a reward that reads the source pixels, eval on image rows (Qwen-Image-Edit with
classifier-free guidance in one forward, Wan2.2 TI2V under DanceGRPO, the rest FlowGRPO) -> ``sp-diffusers export`` ->
plain diffusers, in a process that never imports sp_diffusers, reloads the export (the family's own edit / I2V
pipeline class) and reproduces the trained transformer's output on inputs with a condition; ``sp-diffusers sample
--image`` renders a Wan I2V video under SP as an MP4 that opens. One process group trains every family.

Tolerance as in ``test_trainer_io.py``: ``1e-5 + 1e-5 max|output|`` (the merged LoRA rounded once against base + LoRA
added in the forward); the base model is far outside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ._dist import run_distributed

ROOT = Path(__file__).resolve().parent.parent
REWARDS = ROOT / "examples" / "rewards" / "simple_rewards.py"
FAMILIES = ("flux-kontext", "qwenimage-edit", "qwenimage-edit-plus", "wan-i2v", "wan2.2-i2v", "wan2.2-ti2v")
CLASSES = {
    "flux-kontext": "FluxKontextPipeline",
    "qwenimage-edit": "QwenImageEditPipeline",
    "qwenimage-edit-plus": "QwenImageEditPlusPipeline",
}


def _argv(family: str, pipeline: Path, data: Path, run: Path) -> list[str]:
    two = family == "wan2.2-i2v"
    sets = {
        "model.pipeline": str(pipeline),
        "model.image_size": 4,
        "model.frames": 2,
        "model.condition_area": 32 * 32,
        "parallel.ulysses_sequence_parallel_size": 2,
        # Qwen-Image-Edit-Plus: rows of 1, 2 and 3 images in one run
        "data.train": str(data / ("plus_train.jsonl" if family == "qwenimage-edit-plus" else "train.jsonl")),
        "data.eval": str(data / ("plus_eval.jsonl" if family == "qwenimage-edit-plus" else "eval.jsonl")),
        "train.eval_every": 2,
        "train.sample_every": 2,
        "train.sample_count": 1,
        "train.save_every": 0,
        "train.progress": "false",
        "flowgrpo.rewards": f"[{{fn: {REWARDS}:color_match}}, {{fn: {REWARDS}:source_similarity, weight: 0.5}}]",
        "flowgrpo.num_steps": 3,
        "flowgrpo.window_size": 3 if two else 1,  # Wan2.2: every step, so both experts train
        "flowgrpo.window_range": "[0, 1]" if two else "[0, 2]",
        "flowgrpo.prompts_per_rank": 1,
        "flowgrpo.group_size": 2,
        "flowgrpo.micro_batch_size": 2,
        "text.max_sequence_length": 512,
        "optim.lr": 1e-3,
        "lora.enabled": "true",
        "lora.rank": 4,
        "lora.alpha": 8.0,
        "lora.init": "false",
    }
    if family == "qwenimage-edit":  # CFG in one forward: the empty prompt read with the image, the condition paired
        sets["flowgrpo.cfg_scale"] = 4.0
    if family == "wan2.2-ti2v":  # DanceGRPO (per-sample trained steps: per-sample per-token timesteps)
        sets.update({"flowgrpo.algorithm": "dance_grpo", "flowgrpo.shift": 5.0})
    argv = ["train", "--out-dir", str(run)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("trainer-io-cond")
    data = root / "data"
    shutil.copytree(ROOT / "examples" / "data" / "images", data / "images")
    rows = [
        {"prompt": "make it red", "image": "images/blue.png", "color": "red"},
        {"prompt": "make it green", "image": "images/red.png", "color": "green"},
    ]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "eval.jsonl").write_text(json.dumps({"prompt": "make it blue", "image": "images/green.png"}) + "\n")
    for name in ("plus_train", "plus_eval"):  # the example's rows of 1, 2 and 3 images (relative paths)
        shutil.copy(ROOT / "examples" / "data" / f"edit_{name}.jsonl", data / f"{name}.jsonl")
    pipes = {f: save_tiny_pipeline(f, root / "pipes" / f, num_layers=1) for f in FAMILIES}
    runs = [(f, _argv(f, pipes[f], data, root / "runs" / f), [2]) for f in FAMILIES]
    metrics = run_distributed("tests.workers.trainer_io:train_runs", 2, runs, timeout=1500)[0]
    return {"root": root, "pipes": pipes, "metrics": metrics}


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_on_image_rows_with_a_reward_that_reads_the_source(trained, family):
    lines = trained["metrics"][family]
    assert [m["iteration"] for m in lines] == [1, 2]
    for m in lines:
        # source_similarity reads metadata["source_image"]: it scores -mean|output - source|, finite and < 0
        assert -1.0 <= m["reward/source_similarity"] < 0.0
        assert abs(m["reward_mean"] - (m["reward/color_match"] + 0.5 * m["reward/source_similarity"])) < 1e-5
        assert m["grad_norm"] > 0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert "eval_reward_mean" in lines[1]
    if family == "wan2.2-i2v":
        assert lines[0]["grad_norm/transformer"] > 0 and lines[0]["grad_norm/transformer_2"] > 0
    run = trained["root"] / "runs" / family
    sample = run / "samples" / f"iteration-00000002.{'mp4' if family.startswith('wan') else 'png'}"
    assert sample.stat().st_size > 0


@pytest.fixture(scope="module")
def exported(trained):
    from sp_diffusers.cli import main
    from tests.workers.trainer_io import reference

    cases = {}
    for family in FAMILIES:
        run, out = trained["root"] / "runs" / family, trained["root"] / "export" / family
        assert main(["export", "--run", str(run), "--out", str(out)]) == 0
        ref = trained["root"] / f"ref-{family}.pt"
        reference(str(run), str(ref))
        cases[family] = {"ref": str(ref), "export": str(out)}
    spec = trained["root"] / "cases.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "plain_diffusers.py"), str(spec)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=trained["root"],
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_diffusers_reloads_the_export_with_the_trained_output(exported, family):
    assert exported["sp_diffusers_imported"] is False
    results = exported[family]
    assert set(results) == ({"transformer", "transformer_2"} if family == "wan2.2-i2v" else {"transformer"})
    for r in results.values():
        bound = 1e-5 + 1e-5 * r["scale"]
        for check in ("merged", "pipeline", "lora_adapter", "lora_pipeline"):
            assert r[check] <= bound, (check, r)
        assert r["base"] > 100 * bound, r
        assert r["pipeline_class"] == CLASSES.get(family, "WanImageToVideoPipeline")


def test_sample_renders_an_i2v_video_under_sp_as_an_mp4_that_opens(exported, trained):
    import imageio.v3 as iio

    out = trained["root"] / "sample-i2v.mp4"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "sp_diffusers.cli",
        "sample",
        "--ulysses",
        "2",
    ]
    cmd += [
        "--pipeline",
        str(trained["root"] / "export" / "wan-i2v"),
        "--out",
        str(out),
        "--prompt",
        "a red cat",
    ]
    cmd += [
        "--image",
        str(ROOT / "examples" / "data" / "images" / "red.png"),
        "--steps",
        "3",
        "--height",
        "32",
    ]
    cmd += ["--width", "32", "--frames", "5", "--max-sequence-length", "512"]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    frames = iio.imread(out)  # through imageio-ffmpeg: the file is a video a player opens
    assert frames.shape[0] == 5 and frames.shape[-1] == 3
