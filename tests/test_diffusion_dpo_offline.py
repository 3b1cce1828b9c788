"""Offline Diffusion-DPO: preference pairs read from a file, checked row by row, encoded through the pipeline's VAE
as the pipelines encode an image, and trained instead of rollouts (``flowgrpo.dpo.pairs``), with held-out pairs'
implicit reward margin evaluated (``flowgrpo.dpo.eval_pairs``).

The job (examples/configs/tiny_diffusion_dpo_offline_sp2.yaml: a tiny Qwen-Image pipeline, Ulysses SP 2 on two gloo
ranks, 12 pairs preferring a noisy red picture to a noisy blue one, 16 held-out pairs, 12 iterations). Measured:
the held-out margin at iterations 4, 8, 12 was 4.2, 6.6, 8.4 / 2.1, 4.8, 7.8 / 3.3, 5.5, 7.3 (train.seed 0, 1, 2),
accuracy 0.83-0.94 at the end, and exactly 0 at lr 0 (the policy is the reference: LoRA B = 0). The test asks for a
rising margin ending above 3.6 (half the smallest) with accuracy above 0.7, and the control at 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sp_diffusers.flowgrpo.config import ConfigError
from sp_diffusers.flowgrpo.io.preferences import PairLatents, read_pairs

from ._jobs import ROOT, train_job

CONFIG = "examples/configs/tiny_diffusion_dpo_offline_sp2.yaml"


def _png(path: Path, value: int, size: int = 16) -> str:
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path)
    return path.name


def _write(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "row, match",
    [
        ('{"prompt": "a cat", "chosen": "a.png"', "pairs.jsonl:2 is not JSON"),
        ({"prompt": "a cat", "chosen": "a.png"}, 'pairs.jsonl:2 needs a "prompt", a "chosen" and a "rejected"'),
        ({"prompt": "a cat", "chosen": "a.png", "rejected": "missing.png"}, r"pairs.jsonl:2 \(\"rejected\"\): image 'missing.png'"),
        ({"prompt": "a cat", "chosen": "a.png", "rejected": "./a.png"}, "pairs.jsonl:2: chosen and rejected are the same file"),
    ],
    ids=["not_json", "no_rejected", "missing_file", "same_file"],
)
def test_a_bad_row_is_one_line_naming_it(tmp_path, row, match):
    a, b = _png(tmp_path / "a.png", 10), _png(tmp_path / "b.png", 200)
    good = {"prompt": "a dog", "chosen": a, "rejected": b}
    with pytest.raises(ConfigError, match=match) as err:
        read_pairs(_write(tmp_path, [good, row]), "flowgrpo.dpo.pairs")
    assert "\n" not in str(err.value) and str(err.value).startswith("flowgrpo.dpo.pairs: ")


def test_rows_resolve_relative_to_the_file_and_keep_their_fields(tmp_path):
    (tmp_path / "img").mkdir()
    a, b = _png(tmp_path / "img" / "a.png", 10), _png(tmp_path / "img" / "b.png", 200)
    rows = read_pairs(_write(tmp_path, [{"prompt": "a dog", "chosen": f"img/{a}", "rejected": f"img/{b}", "id": 7}]), "k")
    assert len(rows) == 1 and rows[0].prompt == "a dog" and rows[0].metadata["id"] == 7
    assert rows[0].metadata["chosen"] == str((tmp_path / "img" / "a.png").resolve())
    with pytest.raises(ConfigError, match="holds no pairs"):
        read_pairs(_write(tmp_path, [""]), "k")


def test_pair_latents_refuse_another_size_and_the_same_picture_and_encode_once(tmp_path):
    calls = []

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # any encoder: the pixels' mean per channel
        calls.append(pixels.shape[0])
        return pixels.mean(dim=(2, 3))

    a, b = _png(tmp_path / "a.png", 10), _png(tmp_path / "b.png", 200)
    big, same = _png(tmp_path / "big.png", 10, size=32), _png(tmp_path / "same.png", 10)
    rows = read_pairs(_write(tmp_path, [{"prompt": "p", "chosen": a, "rejected": b}]), "k")
    latents = PairLatents(encode, (16, 16), "flowgrpo.dpo.pairs")
    out = latents(rows + rows)
    assert out.shape == (4, 3) and torch.allclose(out[0], torch.full((3,), 10 / 255)) and calls == [2]
    latents(rows)
    assert calls == [2]  # encoded once
    for other, match in ((big, r"big.png is 32 x 32 \(height x width\), the run's are 16 x 16"), (same, "the same picture")):
        bad = read_pairs(_write(tmp_path, [{"prompt": "p", "chosen": a, "rejected": other}]), "k")
        with pytest.raises(ConfigError, match=match):
            PairLatents(encode, (16, 16), "flowgrpo.dpo.pairs")(bad)


@pytest.mark.parametrize("family", ["qwenimage", "flux", "zimage"])
def test_pixel_encoder_encodes_as_the_pipeline_does(tmp_path, family):
    """Our encoder against the pipeline's own parts: ``vae.encode(...).latent_dist.mode()``, the VAE config's
    normalisation, ``pipeline._pack_latents`` (Z-Image keeps ``[B, C, H, W]``: the inverse of its decode's
    ``z / scaling + shift``); and ``pack_2x2`` inverts ``unpack_2x2``. FLUX.2's encoder is held in
    tests/test_pipeline_io.py (its batch-norm statistics)."""
    import diffusers

    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.decode import PixelEncoder, pack_2x2, unpack_2x2
    from sp_diffusers.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline(family, tmp_path / family, num_layers=1)
    pipe_cls = {"qwenimage": diffusers.QwenImagePipeline, "flux": diffusers.FluxPipeline}.get(family)
    pipe_cls = pipe_cls or diffusers.ZImagePipeline
    pipe = pipe_cls.from_pretrained(folder)
    adapter = build_adapter(pipe.transformer, 8, pooled_from_encoder=True, frames=1, text_len=16, guidance_scale=3.5)
    factor = pipe.vae_scale_factor
    pixels = torch.rand(3, 3, 8 * factor, 8 * factor, generator=torch.Generator().manual_seed(0))
    ours = PixelEncoder(pipe.vae, adapter, "cpu")(pixels)
    with torch.no_grad():
        x = pixels * 2 - 1
        if family == "qwenimage":
            z = pipe.vae.encode(x.unsqueeze(2)).latent_dist.mode()
            mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
            std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
            z = ((z - mean) / std)[:, :, 0]
        else:
            z = pipe.vae.encode(x).latent_dist.mode()
            z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        if family == "zimage":
            torch.testing.assert_close(ours, z, atol=1e-6, rtol=0)
            assert ours.shape == adapter.latent_shape(3)
            return
        theirs = pipe._pack_latents(z, 3, z.shape[1], z.shape[2], z.shape[3])
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)  # the same ops
    assert torch.equal(pack_2x2(unpack_2x2(ours, 8 // 2, 8 // 2)), ours)


def _train(tmp_path: Path, data: Path, lr: float) -> list[dict]:
    sets = {
        "model.pipeline": data / "pipeline",
        "flowgrpo.dpo.pairs": data / "train.jsonl",
        "flowgrpo.dpo.eval_pairs": data / "eval.jsonl",
        "optim.lr": lr,
        "train.save_every": 0,
        "train.plot": "false",
        "train.progress": "false",
    }
    stdout, lines = train_job(CONFIG, tmp_path / f"run-{lr}", sets, iterations=12)
    assert "margin (mean of 5 iterations)" in stdout
    return lines


def test_offline_dpo_raises_the_held_out_margin_against_an_lr_0_control(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "examples/tiny_preference_pairs.py", str(data)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    lines, control = _train(tmp_path, data, 3e-3), _train(tmp_path, data, 0.0)
    assert [m["iteration"] for m in lines] == list(range(1, 13))
    assert all(m["pairs"] == 4.0 and m["trained_samples"] == 8.0 and "reward_mean" not in m for m in lines)
    evals = [m for m in lines if "eval_pairs/implicit_reward_margin" in m]
    margins = [m["eval_pairs/implicit_reward_margin"] for m in evals]
    assert [m["iteration"] for m in evals] == [4, 8, 12]
    assert margins[0] < margins[1] < margins[2] and margins[2] > 3.6, margins
    assert evals[-1]["eval_pairs/implicit_acc"] > 0.7
    assert all(m["eval_pairs/implicit_reward_margin"] == 0.0 for m in control if "eval_pairs/loss" in m)


@pytest.mark.parametrize(
    "sets, match",
    [
        ({}, "model.pipeline is empty"),
        ({"model.pipeline": "p", "model.kind": "ltx"}, "model.kind=ltx: offline pairs are read for qwenimage"),
        ({"model.pipeline": "p", "data.train": "t.jsonl"}, "flowgrpo.dpo.pairs and data.train are both set"),
    ],
    ids=["no_pipeline", "family_without_pairs", "with_data_train"],
)
def test_offline_config_refusals(sets, match):
    from sp_diffusers.flowgrpo.algorithms.registry import algorithm_for
    from sp_diffusers.flowgrpo.config import TrainConfig, apply_overrides

    config = TrainConfig()
    apply_overrides(config, ["flowgrpo.algorithm=diffusion_dpo", "lora.enabled=true", "flowgrpo.dpo.pairs=x.jsonl"])
    apply_overrides(config, [f"{k}={v}" for k, v in sets.items()])
    with pytest.raises(ConfigError, match=match):
        algorithm_for(config)


def test_eval_pairs_need_eval_every():
    from sp_diffusers.flowgrpo.config import TrainConfig, apply_overrides, validate

    config = TrainConfig()
    apply_overrides(config, ["flowgrpo.algorithm=diffusion_dpo", "lora.enabled=true", "flowgrpo.dpo.eval_pairs=e.jsonl"])
    with pytest.raises(ConfigError, match=r"flowgrpo.dpo.eval_pairs.*train.eval_every=N"):
        validate(config)


def _mp4(path: Path, colour: tuple[int, int, int], rng: np.random.Generator, frames: int = 5) -> str:
    from sp_diffusers.flowgrpo.io.media import save_video

    base = torch.tensor(colour, dtype=torch.float32).view(1, 3, 1, 1) / 255.0
    save_video((base + 0.1 * torch.from_numpy(rng.normal(size=(frames, 3, 16, 16))).float()).clamp(0, 1), path)
    return path.name


def test_pixel_encoder_encodes_a_video_as_the_wan_pipeline_does(tmp_path):
    """Wan: ``vae.encode`` of ``[B, 3, F, H, W]``, the posterior's mode, ``(z - latents_mean) / latents_std`` (as
    the Wan image-to-video pipeline normalises its condition)."""
    import diffusers

    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.decode import PixelDecoder, PixelEncoder
    from sp_diffusers.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("wan", tmp_path / "wan", num_layers=1)
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    adapter = build_adapter(pipe.transformer, 8, pooled_from_encoder=True, frames=3, text_len=16, guidance_scale=3.5)
    size = PixelDecoder(pipe.vae, adapter, "cpu")(torch.zeros(adapter.latent_shape(1))).shape
    # [b, F, 3, H, W]: the tiny VAE halves time, so 3 latent frames are 1 + 2 x 2 = 5 pixel frames (diffusers' Wan
    # encoder takes the first frame, then chunks of 4)
    assert tuple(size) == (1, 5, 3, 16, 16)
    pixels = torch.rand(2, 5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    ours = PixelEncoder(pipe.vae, adapter, "cpu")(pixels)
    with torch.no_grad():
        z = pipe.vae.encode((pixels * 2 - 1).permute(0, 2, 1, 3, 4)).latent_dist.mode()
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
        theirs = (z - mean) / std
    assert ours.shape == adapter.latent_shape(2)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_video_pairs_are_checked_by_kind_and_frames(tmp_path):
    rng = np.random.default_rng(0)
    a, b = _mp4(tmp_path / "a.mp4", (220, 30, 30), rng), _mp4(tmp_path / "b.mp4", (30, 30, 220), rng)
    short, img = _mp4(tmp_path / "short.mp4", (30, 30, 220), rng, frames=3), _png(tmp_path / "c.png", 10)

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        return pixels.mean(dim=(1, 3, 4))

    latents = PairLatents(encode, (5, 16, 16), "flowgrpo.dpo.pairs")
    rows = read_pairs(_write(tmp_path, [{"prompt": "p", "chosen": a, "rejected": b}]), "k")
    out = latents(rows)
    assert out.shape == (2, 3) and out[0, 0] > out[0, 2] and out[1, 2] > out[1, 0]  # red, then blue (H.264 kept)
    for other, match in ((short, r"short.mp4 is 3 x 16 x 16 \(frames x height x width\), the run's are 5 x 16 x 16"),
                         (img, "c.png is not a video file")):
        bad = read_pairs(_write(tmp_path, [{"prompt": "p", "chosen": a, "rejected": other}]), "k")
        with pytest.raises(ConfigError, match=match):
            PairLatents(encode, (5, 16, 16), "flowgrpo.dpo.pairs")(bad)
    with pytest.raises(ConfigError, match=r"video 'gone.mp4' \(.*\) does not exist"):
        read_pairs(_write(tmp_path, [{"prompt": "p", "chosen": a, "rejected": "gone.mp4"}]), "k")


def test_offline_video_pairs_train_a_wan_model_at_sp2(tmp_path):
    """A tiny Wan pipeline trained on MP4 pairs at Ulysses SP 2: the videos encoded through its VAE, two updates, the
    held-out pairs' margin moved off 0 (the policy left the reference)."""
    from sp_diffusers.tiny import save_tiny_pipeline

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    save_tiny_pipeline("wan", data / "pipeline", num_layers=2)
    for name in ("train", "eval"):
        rows = [{"prompt": f"a red scene {i}", "chosen": _mp4(data / f"{name}{i}c.mp4", (220, 30, 30), rng),
                 "rejected": _mp4(data / f"{name}{i}r.mp4", (30, 30, 220), rng)} for i in range(4)]
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "wan_dpo.yaml"
    config.write_text(
        f"model: {{kind: wan, pipeline: {data / 'pipeline'}, image_size: 8, frames: 3}}\n"
        "parallel: {ulysses_sequence_parallel_size: 2}\n"
        "text: {max_sequence_length: 16}\n"
        "lora: {enabled: true, rank: 4, alpha: 16}\n"
        "optim: {lr: 1.0e-2}\n"
        f"flowgrpo: {{algorithm: diffusion_dpo, dpo: {{beta: 100.0, pairs: {data / 'train.jsonl'}, "
        f"eval_pairs: {data / 'eval.jsonl'}}}, prompts_per_rank: 2, micro_batch_size: 4}}\n"
        "train: {iterations: 2, eval_every: 2, save_every: 0, plot: false, progress: false}\n"
    )
    _, lines = train_job(config, tmp_path / "run", {})
    assert [m["pairs"] for m in lines] == [2.0, 2.0] and lines[0]["implicit_reward_margin"] == 0.0
    assert all(np.isfinite(m["loss"]) for m in lines)
    assert lines[-1]["eval_pairs/implicit_reward_margin"] != 0.0
