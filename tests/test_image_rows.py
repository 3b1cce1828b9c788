"""Data rows with images (one process): ``"image"`` / ``"images"`` resolved from the file's folder, each checked to exist
and open when the file is read (every rank reads it, so every rank refuses it alike), a refusal one line naming the
file:line, the path and the fix - here and through ``sp-diffusers train --check``; the trainer's rules for rows on a
pipeline with and without an image condition; the source pixels rewards receive."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError
from sp_diffusers.flowgrpo.io.data import read_prompts


def _png(path, color=(200, 40, 40), size=(8, 12)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((*size, 3), color, dtype=np.uint8)).save(path)
    return path


def test_rows_name_images_relative_to_the_file(tmp_path):
    _png(tmp_path / "data" / "img" / "a.png")
    _png(tmp_path / "data" / "img" / "b.png")
    rows = [
        {"prompt": "edit a", "image": "img/a.png", "color": "red"},
        {"prompt": "edit both", "images": ["img/a.png", str(tmp_path / "data" / "img" / "b.png")]},
        {"prompt": "no image"},
    ]
    (tmp_path / "data" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_prompts(tmp_path / "data" / "rows.jsonl")
    img = (tmp_path / "data" / "img").resolve()
    assert got[0].images == (str(img / "a.png"),) and got[0].metadata == {"image": "img/a.png", "color": "red"}
    assert got[1].images == (str(img / "a.png"), str(img / "b.png"))
    assert got[2].images == () and got[0].where.endswith("rows.jsonl:1")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x", "image": "missing.png"}, r"rows\.jsonl:2: image 'missing.png' \(.*missing\.png\) does not exist; fix: "),
        ({"prompt": "x", "image": "not_an_image.png"}, r"rows\.jsonl:2: image 'not_an_image.png' .* cannot be read"),
        ({"prompt": "x", "images": []}, r'rows\.jsonl:2: "images" is \[\], not a non-empty list of path strings'),
        ({"prompt": "x", "image": 3}, r'rows\.jsonl:2: "image" is 3, not a path string'),
        ({"prompt": "x", "image": "a.png", "images": ["a.png"]}, r'rows\.jsonl:2 has both "image" and "images"'),
    ],
)
def test_a_bad_image_is_one_error_naming_the_row(tmp_path, row, message):
    _png(tmp_path / "a.png")
    (tmp_path / "not_an_image.png").write_text("plain text")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "ok", "image": "a.png"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=message) as err:
        read_prompts(tmp_path / "rows.jsonl")
    assert "\n" not in str(err.value) and str(err.value).startswith("data.train: ")


def test_train_check_prints_one_line_for_a_missing_image(tmp_path, capsys):
    from sp_diffusers.cli import main

    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "x", "image": "gone.png"}) + "\n")
    code = main(["train", "--check", "--set", f"data.train={tmp_path / 'rows.jsonl'}"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code != 0
    lines = [ln for ln in text.splitlines() if "gone.png" in ln]
    assert len(lines) == 1 and "rows.jsonl:1" in lines[0] and "fix:" in lines[0], text


def test_rows_and_pipelines_must_agree(tmp_path):
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.models.conditioning import ConditionEncoder, build_conditioning, with_sources

    _png(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "x", "image": "a.png"}) + "\n")
    rows = read_prompts(tmp_path / "rows.jsonl")
    with pytest.raises(ConfigError, match=r"rows\.jsonl:1: the row names an image .* is not conditioned on images; fix"):
        build_conditioning(TrainConfig(), None, None, object(), rows)
    adapter = type("A", (), {"images_per_row": 1, "output_pixels": (4, 6)})()
    encoder = ConditionEncoder(None, adapter, "QwenImageEditPipeline")
    bare = read_prompts(_txt(tmp_path))
    with pytest.raises(ConfigError, match=r"p\.txt:1: the row has no image, and model\.pipeline is a QwenImageEditPipeline"):
        encoder._images(bare)
    # what rewards read: the source at the output's size, [3, H, W] in [0, 1], beside the row's fields
    from sp_diffusers.flowgrpo.io.images import load_row_images, source_pixels

    pixels = torch.stack([source_pixels(load_row_images(rows[0].images, rows[0].where), 4, 6)])
    meta = with_sources([{"color": "red"}], pixels, 1)
    assert meta[0]["color"] == "red" and meta[0]["source_image"].shape == (3, 4, 6)
    assert torch.allclose(meta[0]["source_image"][:, 0, 0], torch.tensor([200, 40, 40]) / 255.0)


def _txt(tmp_path):
    (tmp_path / "p.txt").write_text("a red cat\n")
    return tmp_path / "p.txt"


def test_every_image_mode_is_read_with_its_tonal_range(tmp_path):
    """16-bit greys keep their tone (PIL's own convert("RGB") turned a 30000/65535 grey white), and palette, LA,
    CMYK and an EXIF rotation come out as the 8-bit RGB the pixels show."""
    from PIL import Image

    from sp_diffusers.flowgrpo.io.images import as_rgb, load_row_images

    grey16 = tmp_path / "grey16.png"
    Image.fromarray(np.full((4, 6), 30000, dtype=np.uint16)).save(grey16)
    with Image.open(grey16) as im:
        assert im.mode.startswith("I")  # what a 16-bit PNG opens as
    (rgb,) = load_row_images((str(grey16),), "rows.jsonl row 1")
    assert rgb.mode == "RGB" and rgb.size == (6, 4)
    assert set(np.asarray(rgb).ravel().tolist()) == {round(30000 * 255 / 65535)}  # 117, not 255

    la = Image.fromarray(np.full((2, 2, 2), (90, 255), dtype=np.uint8), mode="LA")
    assert np.asarray(as_rgb(la)).tolist() == [[[90, 90, 90]] * 2] * 2
    palette = Image.fromarray(np.full((2, 2, 3), (10, 200, 30), dtype=np.uint8)).convert("P", palette=Image.ADAPTIVE)
    assert np.asarray(as_rgb(palette))[0, 0].tolist() == [10, 200, 30]
    cmyk = Image.new("CMYK", (2, 2), (0, 0, 0, 0))
    assert np.asarray(as_rgb(cmyk))[0, 0].tolist() == [255, 255, 255]
    floats = Image.fromarray(np.full((2, 2), 0.5, dtype=np.float32), mode="F")
    assert np.asarray(as_rgb(floats))[0, 0].tolist() == [128, 128, 128]

    rotated = tmp_path / "rotated.jpg"
    wide = Image.fromarray(np.zeros((2, 4, 3), dtype=np.uint8))
    exif = wide.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to show upright
    wide.save(rotated, exif=exif)
    (upright,) = load_row_images((str(rotated),), "rows.jsonl row 2")
    assert upright.size == (2, 4)  # width x height once turned


def test_sample_refuses_an_unreadable_image_in_one_line(tmp_path):
    from PIL import Image

    from sp_diffusers.flowgrpo.io.sample import _sources

    good = tmp_path / "good.png"
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)  # does not compress away
    Image.fromarray(noise).save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])

    with pytest.raises(ConfigError, match=r"--image .*truncated\.png cannot be decoded \(.*\); fix: a readable image"):
        _sources("QwenImageEditPipeline", [str(truncated)])
    (image,) = _sources("QwenImageEditPipeline", [str(good)])
    assert image.mode == "RGB"


def test_the_pixel_limit_is_a_setting_and_names_the_row(tmp_path):
    """A decompression bomb (a small file of a huge image) is refused from its header, naming the row and
    data.max_image_pixels; raising the limit (or 0) takes it; PIL's own guard is left as it was."""
    from PIL import Image

    from sp_diffusers.flowgrpo.io.images import load_row_images

    Image.new("L", (4000, 3000)).save(tmp_path / "big.png")  # 12 M pixels in a few kB
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "x", "image": "big.png"}) + "\n")
    with pytest.raises(ConfigError, match=r"rows\.jsonl:1: image 'big.png' .* is 4000 x 3000 = 12000000 pixels, more "
                       r"than data.max_image_pixels=1000000 .*fix: a smaller image, or raise data.max_image_pixels"):
        read_prompts(tmp_path / "rows.jsonl", max_pixels=1_000_000)
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 1_000  # PIL's guard alone would refuse it: the setting decides
    try:
        for limit in (12_000_000, 0):
            (row,) = read_prompts(tmp_path / "rows.jsonl", max_pixels=limit)
            (image,) = load_row_images(row.images, "rows.jsonl:1")
            assert image.size == (4000, 3000)
    finally:
        assert Image.MAX_IMAGE_PIXELS == 1_000
        Image.MAX_IMAGE_PIXELS = saved


@pytest.mark.parametrize("pipeline, most", [("QwenImageEditPlusPipeline", 3), ("QwenImageEditPipeline", 1)])
def test_a_row_with_more_images_than_its_pipeline_takes_is_one_line_naming_it(tmp_path, pipeline, most):
    """Qwen-Image-Edit-Plus edits from 1 to 3 images a row; a 4th (a 2nd for the one-image pipelines) is refused
    naming the row, before any model is built."""
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.models.conditioning import build_conditioning

    for name in "abcd":
        _png(tmp_path / f"{name}.png")
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    rows = [{"prompt": "x", "images": ["a.png"]}, {"prompt": "y", "images": ["a.png", "b.png", "c.png", "d.png"][: most + 1]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = TrainConfig()
    c.model.pipeline = str(folder)
    with pytest.raises(ConfigError, match=rf"rows\.jsonl:2: {most + 1} images, but model\.pipeline's .* takes "
                       rf"{'1 to 3 condition images' if most == 3 else 'one condition image'} per row; fix: at most {most}"):
        build_conditioning(c, None, None, object(), read_prompts(tmp_path / "rows.jsonl"))
