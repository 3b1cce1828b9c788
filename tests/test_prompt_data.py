"""Prompt files (.txt / .jsonl), the per-epoch shuffled stream, where a resumed run continues, eval and sample
media (one process; the same under SP and dp is in tests/test_trainer_io.py)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig, validate
from sp_diffusers.flowgrpo.io.data import PromptRow, PromptStream, read_prompts


def test_txt_and_jsonl_rows(tmp_path):
    (tmp_path / "p.txt").write_text("a red cat\n\n  a blue dog  \n")
    assert read_prompts(tmp_path / "p.txt") == [PromptRow("a red cat"), PromptRow("a blue dog")]
    rows = [{"prompt": "a red cat", "color": "red", "tags": [1, 2]}, {"prompt": "text 'OK'", "ocr": "OK"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_prompts(tmp_path / "p.jsonl")
    assert got == [PromptRow("a red cat", {"color": "red", "tags": [1, 2]}), PromptRow("text 'OK'", {"ocr": "OK"})]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n')
    (tmp_path / "broken.jsonl").write_text('{"prompt": "x"\n')
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "p.csv").write_text("a\n")
    for name, message in (
        ("bad.jsonl", r'data\.eval: .*bad\.jsonl:2 has no "prompt" string'),
        ("broken.jsonl", r"data\.eval: .*broken\.jsonl:1 is not JSON"),
        ("empty.txt", r"holds no prompts"),
        ("p.csv", r"unknown format '\.csv'"),
        ("none.txt", r"no such file"),
    ):
        with pytest.raises(ConfigError, match=message):
            read_prompts(tmp_path / name, "data.eval")


def test_stream_visits_every_row_once_per_epoch_in_a_seeded_order():
    rows = [PromptRow(f"p{i}") for i in range(7)]
    a, b, other = PromptStream(rows, seed=3), PromptStream(rows, seed=3), PromptStream(rows, seed=4)
    epoch0 = [r.prompt for r in a.rows_at(0, 7)]
    epoch1 = [r.prompt for r in a.rows_at(7, 7)]
    assert sorted(epoch0) == sorted(epoch1) == [f"p{i}" for i in range(7)]
    assert epoch0 != epoch1  # reshuffled per epoch
    assert [r.prompt for r in b.rows_at(0, 14)] == epoch0 + epoch1  # the seed alone fixes the order
    assert [r.prompt for r in other.rows_at(0, 7)] != epoch0
    # a read across the epoch boundary, and out of order (a resumed run jumps there), gives the same rows
    assert [r.prompt for r in PromptStream(rows, 3).rows_at(5, 4)] == (epoch0 + epoch1)[5:9]


def test_resume_position_continues_mid_epoch_on_any_layout():
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    def stub(dp: int, base=(0, 0)):
        return types.SimpleNamespace(
            data_base=base,
            engine=types.SimpleNamespace(dp_size=dp),
            config=types.SimpleNamespace(flowgrpo=types.SimpleNamespace(prompts_per_rank=3)),
        )

    # 2 dp ranks x 3 prompts: iteration 5 starts at 30; a checkpoint at 5 stores 30; resumed on 4 dp ranks,
    # iteration 5 starts at 30 and 6 at 42 (not at 5 x 12 = 60)
    assert FlowGRPOTrainer.data_position(stub(2), 5) == 30
    assert FlowGRPOTrainer.data_position(stub(4, (5, 30)), 5) == 30
    assert FlowGRPOTrainer.data_position(stub(4, (5, 30)), 6) == 42


def test_eval_and_sample_keys_are_checked():
    c = TrainConfig()
    c.train.eval_every = 5
    with pytest.raises(ConfigError, match=r"train\.eval_every=5 .*data\.eval=<a \.txt or \.jsonl file>"):
        validate(c)
    c.data.eval, c.train.sample_count = "eval.txt", 0
    with pytest.raises(ConfigError, match=r"train\.sample_count=0"):
        validate(c)


def test_media_png_grid_mp4_that_opens_and_gif_without_a_video_writer(tmp_path, monkeypatch):
    from PIL import Image

    from sp_diffusers.flowgrpo.io import media
    from sp_diffusers.flowgrpo.io.evaluate import latent_preview
    from sp_diffusers.flowgrpo.models.adapters import QwenImageAdapter, WanAdapter

    images = torch.rand(3, 3, 8, 10)
    png = media.save_pixels(images, tmp_path / "grid")
    assert png.suffix == ".png" and Image.open(png).size == (2 * 10 + 2, 2 * 8 + 2)  # 2 x 2 tiles, 2 px gaps
    one = media.save_image(images[0], tmp_path / "one.png")
    back = torch.as_tensor(np.array(Image.open(one))).permute(2, 0, 1).float() / 255
    assert (back - images[0]).abs().max() <= 0.5 / 255 + 1e-6  # uint8 rounding only
    # MP4 through imageio-ffmpeg ([train]): a video that opens again with its frames and, through H.264's 4:2:0
    # chroma and quantisation, about its colours (flat tiles: the codec keeps their mean within a few levels)
    assert media.has_video_writer()
    flat = torch.rand(1, 5, 3, 1, 1).expand(1, 5, 3, 16, 16).clone()
    mp4 = media.save_pixels(flat, tmp_path / "video")
    import imageio.v3 as iio

    frames = iio.imread(mp4)
    assert mp4.suffix == ".mp4" and frames.shape == (5, 16, 16, 3)
    means = torch.as_tensor(frames).float().mean(dim=(1, 2)) / 255
    assert (means - flat[0, :, :, 0, 0]).abs().max() <= 0.06, (means, flat[0, :, :, 0, 0])
    monkeypatch.setattr(media, "has_video_writer", lambda: False)
    gif = media.save_pixels(torch.rand(2, 5, 3, 8, 8), tmp_path / "video")
    assert gif.suffix == ".gif" and Image.open(gif).n_frames == 5
    # without a VAE the grid shows the latents' first channels, scaled to [0, 1]
    q = latent_preview(QwenImageAdapter(4, 4, 16), torch.randn(2, 16, 16))
    assert q.shape == (2, 3, 8, 8) and q.min() >= 0 and q.max() <= 1
    w = latent_preview(WanAdapter(3, 8, 8, 4, (1, 2, 2), 16), torch.randn(2, 4, 3, 8, 8))
    assert w.shape == (2, 3, 3, 8, 8)


@pytest.mark.parametrize(
    "name",
    [
        "tiny_pipeline_sp2.yaml",
        "qwen_image_lora.yaml",
        "flux1_dev_lora.yaml",
        "wan22_a14b_lora.yaml",
        "z_image_turbo_lora.yaml",
        "flux2_klein_lora.yaml",
        "hunyuanvideo15_lora.yaml",
    ],
)
def test_example_configs_load_and_name_loadable_rewards(name, monkeypatch):
    from pathlib import Path

    from sp_diffusers.flowgrpo.config import load_config
    from sp_diffusers.flowgrpo.rewards.loading import reward_specs

    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    c = load_config(root / "examples" / "configs" / name)
    assert c.model.pipeline and c.data.train and c.data.eval and c.train.eval_every > 0
    assert all(s.input == "pixels" for s in reward_specs(c.flowgrpo.rewards, c.flowgrpo.reward))
    if name == "tiny_pipeline_sp2.yaml":
        assert read_prompts(c.data.train)[0].metadata == {"color": "red"} and read_prompts(c.data.eval)
