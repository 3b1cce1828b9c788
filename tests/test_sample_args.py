"""``sp-diffusers sample`` checks every argument before it loads a pipeline, and gives each family the guidance its
pipeline reads: Qwen-Image guides by ``true_cfg_scale`` with a negative prompt, so ``--guidance`` (which it ignores)
is refused and ``--true-cfg`` changes the image; a flag a pipeline does not read is refused (issue 42)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sp_diffusers.flowgrpo.config import ConfigError
from sp_diffusers.flowgrpo.io import sample


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("sample-args")
    return {f: Path(save_tiny_pipeline(f, root / f, num_layers=1)) for f in ("qwenimage", "wan")}


def _render(pipeline, out, **kw):
    return sample.render(pipeline, ["a red cube"], out, steps=2, height=32, width=32, **kw)


@pytest.mark.parametrize(
    "family, kwargs, message",
    [
        ("qwenimage", {"guidance": 4.0}, r"--guidance 4: QwenImagePipeline's transformer has no guidance embedding, so "
         r"its guidance_scale does nothing.*fix: --true-cfg 4 \(and --negative-prompt TEXT"),
        ("wan", {"true_cfg": 4.0}, r"--true-cfg: WanPipeline takes no true_cfg_scale; fix: --guidance 4"),
        ("qwenimage", {"lora": "missing.safetensors"}, r"--lora missing.safetensors: no such file"),
        ("qwenimage", {"images": ["x.png"]}, r"--image: QwenImagePipeline takes no source image"),
        ("qwenimage", {"ulysses": 2}, r"sample --ulysses 2 runs under torchrun"),
        ("wan", {"out": "x.png"}, r"--out .*x.png: WanPipeline is a video pipeline"),
    ],
)
def test_a_bad_argument_is_refused_before_the_pipeline_loads(pipelines, tmp_path, monkeypatch, family, kwargs, message):
    def no_load(*args, **kw):
        raise AssertionError("the pipeline was loaded before the arguments were checked")

    monkeypatch.setattr("sp_diffusers.flowgrpo.models.pipeline_io.from_pretrained", no_load)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / kwargs.pop("out", "x.png" if family == "qwenimage" else "x.mp4")
    with pytest.raises((ConfigError, SystemExit), match=message):
        _render(pipelines[family], out, **kwargs)


def test_true_cfg_guides_qwen_image_and_is_quiet_without_it(pipelines, tmp_path, caplog):
    pixels = {}
    for name, kw in {"plain": {}, "cfg1": {"true_cfg": 1.0}, "cfg8": {"true_cfg": 8.0}}.items():
        with caplog.at_level("WARNING"):
            path = _render(pipelines["qwenimage"], tmp_path / f"{name}.png", **kw)
        pixels[name] = np.asarray(Image.open(path))
    assert "not enabled" not in caplog.text  # diffusers' true_cfg_scale warning: no negative prompt, no guidance
    assert np.array_equal(pixels["plain"], pixels["cfg1"])  # 1: no guidance, what the default was
    assert not np.array_equal(pixels["cfg1"], pixels["cfg8"])  # 8 with the negative prompt ' ': guided


def test_guidance_sets_the_guider_of_a_pipeline_that_guides_through_one(tmp_path):
    """HunyuanVideo-1.5's ``__call__`` takes no ``guidance_scale``: its folder's ``ClassifierFreeGuidance`` guides.
    ``--guidance g`` is that guider's scale (the folder's is 6): 6 renders what no flag renders, 1 (no CFG) differs."""
    from sp_diffusers.flowgrpo.io.media import read_video
    from sp_diffusers.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("hunyuanvideo15", tmp_path / "hv", num_layers=1)
    frames = {}
    for name, kw in {"folder": {}, "six": {"guidance": 6.0}, "one": {"guidance": 1.0}}.items():
        out = sample.render(folder, ["a red cube"], tmp_path / f"{name}.mp4", steps=2, height=16, width=16, frames=5, **kw)
        frames[name] = read_video(out)
    assert torch.equal(frames["folder"], frames["six"])
    assert not torch.equal(frames["six"], frames["one"])
