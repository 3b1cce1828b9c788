"""A config must agree with its model folder (issue 33): ``model.kind`` against the pipeline's (or transformer's)
class, the components the run loads, in ``train`` and in ``train --check``; one error naming both sides and the fix.

Each case runs the CLI's ``main`` in this process (no launcher: the checks come before any process group, engine or
weight) on tiny pipeline folders written with ``save_pretrained``. ``--check`` must not read a weight: the transformer
file of the folder it checks is overwritten with garbage first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sp_diffusers.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
FIX = "fix: model.kind=qwenimage, or leave model.kind out (it is taken from the folder)"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("model-folders")
    out = {f: save_tiny_pipeline(f, root / f, num_layers=1) for f in ("qwenimage", "wan")}
    for folder in out.values():  # --check reads JSON only: a weight it read would fail to parse
        for weights in (Path(folder) / "transformer").glob("*.safetensors"):
            weights.write_bytes(b"not a safetensors file")
    return {k: Path(v) for k, v in out.items()}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def _error(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("sp-diffusers train: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("check", [True, False], ids=["check", "train"])
@pytest.mark.parametrize(
    "config, kind, pipeline_class",
    [("tiny_wan_sp2.yaml", "wan", "WanPipeline"), ("flux1_dev_lora.yaml", "flux", "FluxPipeline"),
     ("wan22_a14b_lora.yaml", "wan", "WanPipeline"), ("z_image_turbo_lora.yaml", "zimage", "ZImagePipeline"),
     ("flux2_klein_lora.yaml", "flux2", "Flux2KleinPipeline or Flux2Pipeline"),
     ("flux2_dev_lora.yaml", "flux2", "Flux2KleinPipeline or Flux2Pipeline"),
     ("hunyuanvideo15_lora.yaml", "hunyuanvideo15", "HunyuanVideo15Pipeline"),
     ("ltx2_lora.yaml", "ltx2", "LTX2Pipeline")],
)
def test_a_kind_that_disagrees_with_its_pipeline_folder_is_refused(
    capsys, monkeypatch, tmp_path, folders, config, kind, pipeline_class, check
):
    monkeypatch.chdir(ROOT)
    argv = ["train", "--config", str(CONFIGS / config), "--set", f"model.pipeline={folders['qwenimage']}"]
    argv += ["--set", "parallel.ulysses_sequence_parallel_size=1", "--out-dir", str(tmp_path / "run")]
    status, out, err = _run(capsys, *argv, *(["--check"] if check else []))
    assert status == 2 and "config OK" not in out
    line = _error(err)
    assert (
        f"model.kind={kind!r} but model.pipeline='{folders['qwenimage']}' is a QwenImagePipeline folder"
        in line
    )
    assert FIX in line and f"model.pipeline=<a {pipeline_class} folder>" in line
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything


def test_check_reports_the_folder_without_loading_weights(capsys, monkeypatch, folders):
    monkeypatch.chdir(ROOT)
    argv = [
        "train",
        "--config",
        str(CONFIGS / "tiny_pipeline_sp2.yaml"),
        "--set",
        f"model.pipeline={folders['qwenimage']}",
    ]
    status, out, err = _run(capsys, *argv, "--check")
    assert status == 0, err
    lines = out.splitlines()
    assert (
        lines[0]
        == f"model.pipeline={folders['qwenimage']}: a QwenImagePipeline; model.kind=qwenimage (taken from the folder)"
    )
    assert "  transformer: QwenImageTransformer2DModel (trained)" in lines
    assert "  vae: AutoencoderKLQwenImage (decodes pixels for the reward(s) color_match, brightness)" in lines
    assert "  text_encoder: Qwen2_5_VLForConditionalGeneration (encodes the prompts)" in lines
    assert "  scheduler: FlowMatchEulerDiscreteScheduler (the rollout schedule)" in lines
    assert "rewards: color_match (reads pixels, weight 1), brightness (reads pixels, weight 0.5)" in lines
    assert lines[-1].startswith("config OK: ")
    # a given kind that agrees is reported as given
    status, out, _ = _run(capsys, *argv, "--set", "model.kind=qwenimage", "--check")
    assert status == 0 and "model.kind=qwenimage (given)" in out


def _without(folder: Path, tmp_path: Path, component: str, *, unlist: bool) -> Path:
    """A copy of ``folder`` lacking ``component``: unlisted in model_index.json, or listed with no subfolder."""
    copy = tmp_path / f"{folder.name}-no-{component}"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / component)
    if unlist:
        index = json.loads((copy / "model_index.json").read_text())
        index[component] = [None, None]
        (copy / "model_index.json").write_text(json.dumps(index))
    return copy


@pytest.mark.parametrize("check", [True, False], ids=["check", "train"])
def test_components_the_run_needs_must_be_in_the_folder(capsys, monkeypatch, tmp_path, folders, check):
    monkeypatch.chdir(ROOT)
    flag = ["--check"] if check else []
    common = ["--set", "parallel.ulysses_sequence_parallel_size=1", "--out-dir", str(tmp_path / "run")]
    # rewards on pixels need a VAE
    no_vae = _without(folders["qwenimage"], tmp_path, "vae", unlist=True)
    argv = [
        "train",
        "--config",
        str(CONFIGS / "tiny_pipeline_sp2.yaml"),
        "--set",
        f"model.pipeline={no_vae}",
        *common,
    ]
    status, _, err = _run(capsys, *argv, *flag)
    line = _error(err)
    assert status == 2 and f"model.pipeline='{no_vae}' has no vae (its model_index.json lists none)" in line
    assert "this run needs it (decodes pixels for the reward(s) color_match, brightness)" in line
    assert "fix: a pipeline folder with its vae, or input: latents for those rewards" in line
    # the same folder trains a latent reward: no VAE needed
    latent = ["--set", "flowgrpo.rewards=[]", "--set", "flowgrpo.reward=color"]
    assert _run(capsys, *argv, *latent, "--check")[0] == 0
    # a text encoder listed but not there
    no_text = _without(folders["qwenimage"], tmp_path, "text_encoder", unlist=False)
    status, _, err = _run(capsys, "train", "--set", f"model.pipeline={no_text}", *common, *flag)
    assert (
        status == 2
        and "has no text_encoder (no text_encoder/ subfolder), and this run needs it" in _error(err)
    )
    # two experts asked of a one-expert (Wan2.1) folder
    argv = [
        "train",
        "--config",
        str(CONFIGS / "wan22_a14b_lora.yaml"),
        "--set",
        f"model.pipeline={folders['wan']}",
    ]
    status, _, err = _run(capsys, *argv, *common, *flag)
    line = _error(err)
    assert status == 2 and f"model.pipeline='{folders['wan']}' has no transformer_2" in line
    assert "this run needs it (trained)" in line and "model.experts=[transformer]" in line


def test_kind_left_out_is_taken_from_the_folder_and_a_transformer_folder_counts_too(
    capsys, tmp_path, folders
):
    from sp_diffusers.flowgrpo.config import TrainConfig, load_config
    from sp_diffusers.flowgrpo.models.pipeline_io import resolve_pipeline

    c = load_config(None, [f"model.pipeline={folders['wan']}"])
    assert c.model.kind == "" and resolve_pipeline(c) == "wan"  # left out: the folder's
    assert load_config(None, []).model.kind == "qwenimage"  # no folder: the tiny default
    c = TrainConfig()
    c.model.pretrained = str(folders["wan"] / "transformer")
    assert resolve_pipeline(c) == "wan"
    argv = [
        "train",
        "--set",
        "model.kind=qwenimage",
        "--pretrained",
        str(folders["wan"] / "transformer"),
        "--check",
    ]
    status, _, err = _run(capsys, *argv)
    line = _error(err)
    assert (
        status == 2
        and "model.kind='qwenimage' builds a QwenImageTransformer2DModel, but model.pretrained=" in line
    )
    assert (
        "holds a WanTransformer3DModel (model.kind 'wan'); fix: model.kind=wan, or leave model.kind out"
        in line
    )
    status, _, err = _run(capsys, "train", "--set", "model.kind=qwen", "--check")
    assert status == 2 and "model.kind='qwen' is invalid: one of qwenimage, flux" in _error(err)
