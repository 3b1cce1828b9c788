"""The image-conditioned families in: for each (Qwen-Image-Edit and its Plus, FLUX.1 Kontext, Wan2.1 I2V, Wan2.2
I2V-A14B, Wan2.2 TI2V-5B) the pipeline's own ``__call__`` runs on a tiny folder with a source image and every
transformer call is recorded; the trainer's parts built from the same folder (text encoder, the condition's adapter
and encoder, schedule) must hand the transformer the same inputs at the same timesteps: the condition tokens beside
the noisy ones, their ids / image shapes, CLIP image tokens, first-frame masks and per-token timesteps.

Condition size: Qwen-Image-Edit and Kontext resize the condition image to about 1 MP whatever the output; the trainer
takes the pipeline's rule at ``model.condition_area`` (``models/edit.py``). Here both sides use 64 x 128 px: the
pipeline module's area constant is pointed there (Qwen-Image-Edit's ``calculate_dimensions`` target, Plus's
``VAE_IMAGE_SIZE``), Kontext runs with ``_auto_resize=False`` on a source of that size. Tolerance: fp32 ``1e-5``
absolute (both sides run the same modules on the same inputs; the trainer encodes one prompt at a time, the pipeline
too, so the text is bit-identical, the VAE latents too).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.config import TrainConfig

FAMILIES = ("flux-kontext", "qwenimage-edit", "qwenimage-edit-plus", "wan-i2v", "wan2.2-i2v", "wan2.2-ti2v")
PROMPT = "make the cat blue"
AREA = 64 * 128  # the condition's pixels for the edit families (the output's: latent 8 x 16, VAE 8x)


def _image(h: int, w: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("cond-pipes")
    return {f: save_tiny_pipeline(f, root / f, num_layers=1) for f in FAMILIES}


def _load(folder):
    from diffusers import DiffusionPipeline

    from sp_diffusers.families.processors import load_qwen_vl_processor

    index = json.loads((folder / "model_index.json").read_text())
    extra = {"processor": load_qwen_vl_processor(folder / "processor")} if "processor" in index else {}
    pipe = DiffusionPipeline.from_pretrained(folder, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _record(pipe, family, image, monkeypatch):
    import importlib

    calls, timesteps = [], []
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is not None:
            model.register_forward_pre_hook(lambda m, a, kw, n=name: calls.append((n, dict(kw))), with_kwargs=True)
    kwargs = dict(prompt=[PROMPT], image=image, num_inference_steps=3, output_type="latent")
    kwargs["callback_on_step_end"] = lambda p, i, t, k: timesteps.append(float(t)) or {}
    if family.startswith("wan"):
        kwargs.update(height=32, width=64, num_frames=5, guidance_scale=1.0, max_sequence_length=512)
    else:
        kwargs.update(height=64, width=128, max_sequence_length=512)
    if family == "flux-kontext":
        kwargs.update(max_area=64 * 128, _auto_resize=False)
    if family.startswith("qwenimage-edit"):
        module = importlib.import_module(type(pipe).__module__)
        calc = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda area, r: calc(AREA if area == 1024**2 else area, r))
    pipe(**kwargs, generator=torch.Generator().manual_seed(0))
    return calls, timesteps


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_condition_equals_the_pipelines(folders, family, monkeypatch, tmp_path):
    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.io.data import read_prompts
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.conditioning import build_conditioning
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline
    from sp_diffusers.parallel.padding import pad_text_batch

    video = family.startswith("wan")
    source = _image(32, 64) if video else _image(64, 128)  # the output's aspect ratio
    images = [source, _image(64, 128, seed=1)] if family == "qwenimage-edit-plus" else source
    calls, timesteps = _record(_load(folders[family]), family, images, monkeypatch)

    for i, im in enumerate(images if isinstance(images, list) else [images]):
        im.save(tmp_path / f"src{i}.png")
    names = ["src0.png", "src1.png"] if family == "qwenimage-edit-plus" else ["src0.png"]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": PROMPT, "images": names}) + "\n")
    rows = read_prompts(tmp_path / "rows.jsonl")

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width, c.model.frames = str(folders[family]), 8, 16, 2
    c.model.condition_area, c.text.max_sequence_length, c.flowgrpo.num_steps = AREA, 512, 3
    if family == "wan2.2-i2v":
        c.flowgrpo.window_size, c.flowgrpo.window_range = 1, [0, 2]
    resolve_pipeline(c)
    model = load_transformers(c)["transformer"]
    text = build_text_encoder(c, torch.device("cpu"))
    base = build_adapter(model, 8, True, 2, 512, image_width=16)
    adapter, encoder = build_conditioning(c, model, text, base, rows)
    schedule = run_schedule(c, adapter)
    assert schedule.timesteps.tolist() == pytest.approx(timesteps, abs=1e-4)

    batch = encoder.encode(rows, repeat=1)
    embeds, mask = pad_text_batch(batch["prompt_embeds"], batch["prompt_embeds_mask"], 1, "prompt_embeds")
    condition = {k: v for k, v in batch.items() if k.startswith("condition_")}
    assert batch["source_pixels"].shape == (1, len(names), 3, *adapter.output_pixels)
    assert len(calls) == 3
    for i, (_, call) in enumerate(calls):
        hidden = call["hidden_states"]
        noisy = hidden[:, : adapter.tokens] if not video else hidden[:, : adapter.channels]
        ours = adapter.inputs(noisy, schedule.timesteps[i], embeds, mask, batch.get("pooled_prompt_embeds"), condition)
        shared = set(ours) & set(call)
        assert {"hidden_states", "timestep", "encoder_hidden_states"} <= shared
        for key in shared:
            want, got = call[key], ours[key]
            if key == "encoder_hidden_states_mask" and want is None:  # the pipeline drops an all-True mask
                want = torch.ones_like(got)
            if not torch.is_tensor(got):  # img_shapes
                assert got == want, f"{family} step {i}: {key}"
                continue
            assert want is not None and got.shape == want.shape, f"{family} step {i}: {key}"
            torch.testing.assert_close(got.to(want.dtype), want, atol=1e-5, rtol=0, msg=f"{family} step {i}: {key}")
        if family == "wan-i2v":
            assert "encoder_hidden_states_image" in shared
        if family == "wan2.2-ti2v":
            assert call["timestep"].shape == (1, adapter.tokens) and float(call["timestep"][0, 0]) == 0.0
    if family == "wan2.2-i2v":
        assert {n for n, _ in calls} == {"transformer", "transformer_2"}


@pytest.mark.parametrize("family", ["qwenimage-edit", "wan2.2-ti2v"])
def test_cfg_in_one_forward_pairs_the_condition(folders, family, tmp_path):
    """Classifier-free guidance as one forward of 2B samples (the condition repeated for the unconditional branch,
    Qwen-Image-Edit's empty prompt read with the image) equals the two forwards, to fp32 rounding (the texts' padding
    differs: masked keys for Qwen-Image; Wan zero-pads to its fixed length either way)."""
    from sp_diffusers.flowgrpo.build import build_text_encoder
    from sp_diffusers.flowgrpo.io.data import read_prompts
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.conditioning import build_conditioning
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline
    from sp_diffusers.flowgrpo.sampling.denoise import velocity
    from sp_diffusers.parallel.padding import pad_text_batch

    _image(32, 64).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": PROMPT, "image": "a.png"}) + "\n")
    rows = read_prompts(tmp_path / "rows.jsonl")
    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width, c.model.frames = str(folders[family]), 8, 16, 2
    c.model.condition_area, c.text.max_sequence_length = AREA, 512
    resolve_pipeline(c)
    model = load_transformers(c)["transformer"].eval()
    adapter, encoder = build_conditioning(
        c, model, build_text_encoder(c, torch.device("cpu")), build_adapter(model, 8, True, 2, 512, image_width=16), rows
    )
    batch = encoder.encode(rows, repeat=2, negative=True)
    cond = {k: v for k, v in batch.items() if k.startswith("condition_")}
    for prefix in ("", "negative_"):
        cond[f"{prefix}prompt_embeds"], cond[f"{prefix}prompt_embeds_mask"] = pad_text_batch(
            batch[f"{prefix}prompt_embeds"], batch[f"{prefix}prompt_embeds_mask"], 1, "prompt_embeds"
        )
    engine = type("E", (), {"model": model, "forward": lambda self, **kw: model(**kw, return_dict=False)[0]})()
    x = torch.randn(adapter.latent_shape(2), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        one = velocity(engine, adapter, x, torch.tensor(700.0), cond, 4.0, cfg_batch=True)
        two = velocity(engine, adapter, x, torch.tensor(700.0), cond, 4.0, cfg_batch=False)
    assert one.shape == x.shape
    torch.testing.assert_close(one, two, atol=1e-5 * float(two.abs().max()), rtol=0)
