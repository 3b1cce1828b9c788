"""Rewards you bring: loading by import path or file, the weighted total, pixels decoded as each pipeline decodes
them, the CLIP reward on a tiny random CLIP, and scoring split over the SP group with one error on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError
from sp_diffusers.flowgrpo.rewards.loading import load_callable, reward_specs
from sp_diffusers.flowgrpo.rewards.scoring import RewardError, RewardSet

from ._dist import run_distributed

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples/rewards/simple_rewards.py"


def test_load_callable_by_module_file_and_builtin(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert load_callable("sp_diffusers.flowgrpo.rewards.clip:clip_score").__name__ == "clip_score"
    by_file = load_callable(f"{EXAMPLE}:brightness")
    assert by_file.__name__ == "brightness"
    assert load_callable(f"{ROOT / EXAMPLE}:brightness") is by_file  # one module per file
    assert load_callable("color").__name__ == "ColorLatentReward"
    cases = [
        ("brightness", r"names no callable.*'pkg\.module:callable'"),
        ("no/such/file.py:f", r"no file no/such/file\.py"),
        (f"{EXAMPLE}:nope", r"has no 'nope'; its callables: brightness, color_match"),
        ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
        ("sp_diffusers.flowgrpo.rewards.clip:_MEAN", r"is a tuple, not a callable"),
    ]
    for ref, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_callable(ref, "flowgrpo.rewards[0].fn")


def test_reward_specs_check_every_entry(monkeypatch):
    monkeypatch.chdir(ROOT)
    (spec,) = reward_specs([], "video_color")
    assert spec.name == "video_color" and spec.input == "latents"
    specs = reward_specs(
        [{"fn": f"{EXAMPLE}:brightness", "weight": 2, "kwargs": {"target": 0.3}}, "mean_latent"], "color"
    )
    assert [(s.name, s.weight, s.input) for s in specs] == [("brightness", 2.0, "pixels"), ("mean_latent", 1.0, "latents")]
    bad = [
        ([{"fn": "color", "weight": float("nan")}], r"rewards\[0\]\.weight=nan must be a finite number"),
        ([{"fn": "color", "input": "pixels"}], r"built-in reward 'color' reads latents"),
        ([{"fn": f"{EXAMPLE}:brightness", "input": "rgb"}], r"rewards\[0\]\.input='rgb': choose 'pixels'"),
        ([{"weight": 1}], r"rewards\[0\] needs one of fn \(a callable"),
        ([{"fn": "color", "wieght": 1}], r"unknown key\(s\) \['wieght'\]"),
        (["color", "color"], r"name\(s\) \['color'\] are used twice"),
        ([{"fn": "color", "kwargs": [1]}], r"kwargs must be a mapping"),
    ]
    for rewards, message in bad:
        with pytest.raises(ConfigError, match=message):
            reward_specs(rewards, "color")
    with pytest.raises(ConfigError, match=r"flowgrpo\.reward='pickscore' is not built in"):
        reward_specs([], "pickscore")


def _tokens(b: int = 4) -> torch.Tensor:
    return torch.randn(b, 16, 8, generator=torch.Generator().manual_seed(0))


def test_weighted_total_metadata_and_failures(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    f = tmp_path / "r.py"
    f.write_text(
        "import torch\n"
        "def first(x, prompts, metadata, scale=1.0):\n"
        "    return torch.tensor([scale * m['v'] for m in metadata])\n"
        "def length(x, prompts, metadata):\n"
        "    return [float(len(p)) for p in prompts]\n"
        "def nan(x, prompts, metadata):\n"
        "    return torch.full((x.shape[0],), float('nan'))\n"
        "def wide(x, prompts, metadata):\n"
        "    return torch.zeros(x.shape[0], 2)\n"
        "def boom(x, prompts, metadata):\n"
        "    raise KeyError('score')\n"
    )
    entries = [
        {"fn": f"{f}:first", "weight": 0.5, "input": "latents", "kwargs": {"scale": 2.0}},
        {"fn": f"{f}:length", "weight": -1.0, "input": "latents", "name": "len"},
    ]
    rs = RewardSet(reward_specs(entries, "color"), lambda x: x)
    prompts, meta = ["a", "bb", "ccc", "dddd"], [{"v": float(i)} for i in range(4)]
    scores = rs(_tokens(), prompts, meta)
    total, parts = scores.total, scores.each
    assert scores.features is None  # no algorithm asked for features
    torch.testing.assert_close(parts["first"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    torch.testing.assert_close(parts["len"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.testing.assert_close(total, 0.5 * parts["first"] - parts["len"])
    for name, message in (
        ("nan", r"reward 'nan' \(.*r\.py:nan\) returned non-finite values \(\[nan, nan, nan, nan\]\) for sample\(s\) \[0, 1, 2, 3\]"),
        ("wide", r"reward 'wide' .* returned shape \(4, 2\); it must return one float per sample: shape \[4\]"),
        ("boom", r"reward 'boom' .* raised KeyError: 'score' at .*r\.py:11"),
    ):
        rs = RewardSet(reward_specs([{"fn": f"{f}:{name}", "input": "latents"}], "color"), lambda x: x)
        with pytest.raises(RewardError, match=message):
            rs(_tokens(), prompts, meta)
    with pytest.raises(ConfigError, match=r"'brightness' .* read\(s\) pixels, but this run has no VAE.*model\.pipeline"):
        RewardSet(reward_specs([{"fn": f"{EXAMPLE}:brightness"}], "color"), lambda x: x)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    return {f: save_tiny_pipeline(f, root / f, num_layers=1) for f in ("qwenimage", "sd3", "wan")}


def _adapter(family: str, model):
    from sp_diffusers.flowgrpo.models.adapters import build_adapter

    return build_adapter(model, 8, pooled_from_encoder=True, frames=2, text_len=16)


@pytest.mark.parametrize("family", ["qwenimage", "sd3", "wan"])
def test_pixels_decode_as_the_pipeline_decodes(pipelines, family):
    """The pipeline's own __call__ twice from one seed: its latents through PixelDecoder equal its decoded output."""
    from diffusers import DiffusionPipeline

    from sp_diffusers.flowgrpo.models.decode import PixelDecoder

    pipe = DiffusionPipeline.from_pretrained(pipelines[family])
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=["a red cat", "a blue dog"], num_inference_steps=2, height=16, width=16)
    if family == "wan":
        kwargs.update(num_frames=3, guidance_scale=1.0, max_sequence_length=16)
    elif family == "sd3":
        kwargs.update(max_sequence_length=16)

    def run(output_type):
        out = pipe(**kwargs, output_type=output_type, generator=torch.Generator().manual_seed(3))
        return out.frames if family == "wan" else out.images

    latents = run("latent")
    expected = torch.as_tensor(run("np"))  # [b, H, W, 3] / [b, F, H, W, 3] in [0, 1]
    decoder = PixelDecoder(pipe.vae, _adapter(family, pipe.transformer), "cpu", chunk=1)
    pixels = decoder(latents)
    assert pixels.shape == expected.movedim(-1, -3).shape
    torch.testing.assert_close(pixels, expected.movedim(-1, -3), atol=1e-6, rtol=0)  # one float32 path


def test_clip_reward_on_a_tiny_random_clip(tmp_path):
    from transformers import AutoTokenizer, CLIPModel

    from sp_diffusers.flowgrpo.rewards.clip import clip_score
    from sp_diffusers.tiny import save_tiny_clip

    folder = save_tiny_clip(tmp_path / "clip")
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prompts = ["a red cat", "a house", "blue"]
    got = clip_score(images, prompts, [{}] * 3, model=str(folder))
    clip, tok = CLIPModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    t = tok(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = clip(input_ids=t.input_ids, attention_mask=t.attention_mask, pixel_values=(images - 0.5) / 0.25)
    expected = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # fp32; same model, same inputs
    # another size is resized and cropped to 32; a video scores the mean of its frames
    video = torch.stack([images, images.flip(0)], dim=1)  # [3, F=2, 3, 32, 32]
    per_frame = [clip_score(video[:, i], prompts, [{}] * 3, model=str(folder)) for i in range(2)]
    torch.testing.assert_close(clip_score(video, prompts, [{}] * 3, model=str(folder)), (per_frame[0] + per_frame[1]) / 2)
    assert clip_score(torch.rand(3, 3, 48, 40), prompts, [{}] * 3, model=str(folder)).shape == (3,)
    assert (clip_score(images, prompts, [{}] * 3, model=str(folder), scale=100, clamp=True) >= 0).all()
    with pytest.raises(FileNotFoundError, match=r"model='nowhere' is not a CLIP folder"):
        clip_score(images, prompts, [{}] * 3, model="nowhere")


def test_scoring_is_split_over_the_sp_group_and_failures_reach_every_rank(tmp_path):
    module = tmp_path / "counting.py"
    module.write_text(
        "import torch\n"
        "CALLS = []\n"
        "def score(x, prompts, metadata):\n"
        "    CALLS.append(len(prompts))\n"
        "    return x.float().flatten(1).mean(dim=1)\n"
        "def rank1_fails(x, prompts, metadata):\n"
        "    import torch.distributed as dist\n"
        "    if dist.get_rank() == 1:\n"
        "        raise ValueError('no model on this rank')\n"
        "    return torch.zeros(x.shape[0])\n"
    )
    results = run_distributed("tests.workers.reward_checks:split_scoring", 2, str(module))
    expected = results[0]["single"]
    for r in results:
        torch.testing.assert_close(r["total"], expected)  # every SP rank has every sample's score
        assert "on rank 1, reward 'rank1_fails'" in r["error"] and "raised ValueError: no model on this rank" in r["error"]
    # 5 samples over 2 SP ranks: rank 0 scores 3, rank 1 scores 2 (tensor_split), each once
    assert [r["calls"] for r in results] == [[3], [2]]
    for r in results:  # the features ride with the scores: every rank has every sample's, exactly (float64 copies)
        assert torch.equal(r["features"], r["expected_features"])
        torch.testing.assert_close(r["features_total"], 2 * expected)  # the view doubles what the reward reads


def test_the_clip_reward_s_old_import_path_still_loads_it_with_a_warning():
    """Configs written before flowgrpo/ was split into folders name sp_diffusers.flowgrpo.clip_reward."""
    import pytest

    from sp_diffusers.flowgrpo.rewards.clip import clip_score
    from sp_diffusers.flowgrpo.rewards.loading import load_callable

    with pytest.warns(UserWarning, match=r"is now sp_diffusers\.flowgrpo\.rewards\.clip; fix: name that module"):
        assert load_callable("sp_diffusers.flowgrpo.clip_reward:clip_score") is clip_score


def test_image_features_come_from_a_dino_folder_beside_the_rewards(tmp_path):
    """GARDO's features: a tiny DINOv2 folder (sp_diffusers.tiny.save_tiny_dino) reads the pixels the rewards read;
    ``features=False`` (evaluation) leaves them out; a folder without a model is one line naming the key."""
    import pytest

    from sp_diffusers.flowgrpo.config import ConfigError
    from sp_diffusers.flowgrpo.rewards.features import ImageFeatures, features_for
    from sp_diffusers.tiny import save_tiny_dino

    folder = save_tiny_dino(tmp_path / "dino")
    features = features_for(str(folder), "cpu")
    assert isinstance(features, ImageFeatures) and features.size == 32
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    decode = lambda latents: images[: latents.shape[0]]  # noqa: E731  (a stand-in VAE: the latents' pixels)
    rs = RewardSet(reward_specs([], "color"), lambda x: x, decode=decode, features=features)
    scores = rs(_tokens(), ["a red cat"] * 4)
    assert scores.features.shape == (4, 32) and scores.features.dtype == torch.float64
    torch.testing.assert_close(scores.features, features(images))
    # a different picture, a different feature: the model reads the pixels
    assert not torch.allclose(scores.features[0], scores.features[1])
    assert rs(_tokens(), ["a red cat"] * 4, features=False).features is None
    video = features(images.view(2, 2, 3, 16, 16))  # a video's feature: its frames' mean
    torch.testing.assert_close(video, features(images).view(2, 2, -1).mean(dim=1))
    with pytest.raises(FileNotFoundError, match=r"flowgrpo.gardo.features='nowhere' is not a model folder"):
        features_for("nowhere", "cpu")
    with pytest.raises(ConfigError, match=r"flowgrpo.gardo.features: an image model reads pixels, but this run has no VAE"):
        RewardSet(reward_specs([], "color"), lambda x: x, features=features)
