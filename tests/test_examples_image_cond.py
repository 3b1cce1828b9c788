"""The README's recipe for the image-conditioned families, run as a user runs it:
``FAMILY=<family> bash examples/run_trainer_io_tiny.sh`` builds the tiny pipeline folder, trains it at Ulysses SP = 2
under torchrun on the example image rows (one iteration here, with its eval, sample grid and checkpoint), exports it
and samples the export under SP with ``--image``. ``tests/test_trainer_io_cond.py`` holds what the outputs must equal
(plain diffusers reloading the export); this file holds that the script itself works for every family it names.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("flux-kontext", "qwenimage-edit", "qwenimage-edit-plus", "wan-i2v", "wan2.2-i2v", "wan2.2-ti2v")
ONE_ITERATION = [f"--set=train.{key}=1" for key in ("iterations", "save_every", "eval_every", "sample_every")]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_recipe_trains_exports_and_samples(tmp_path: Path, family: str) -> None:
    env = dict(os.environ, FAMILY=family, RUNS=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run(
        ["bash", "examples/run_trainer_io_tiny.sh", *ONE_ITERATION],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run, export = tmp_path / f"tiny-{family}-sp2", tmp_path / f"tiny-{family}-export"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "reward_mean" in row]
    assert len(trained) == 1 and trained[0]["iteration"] == 1, rows
    assert any(key.startswith("reward/source_similarity") for key in trained[0]), trained[0]  # read the source
    index = json.loads((export / "model_index.json").read_text())
    two = index.get("transformer_2", [None])[0] is not None  # Wan's I2V pipeline names the slot, empty for one expert
    assert two == (family == "wan2.2-i2v"), index  # both experts exported
    if family.startswith("wan"):
        import imageio.v3 as iio

        frames = iio.imread(run / "sample.mp4")  # through imageio-ffmpeg: a video a player opens
        assert frames.ndim == 4 and frames.shape[0] >= 5, frames.shape
    else:
        from PIL import Image

        with Image.open(run / "sample.png") as image:
            assert image.size[0] > 0 and image.size[1] > 0
