"""The planner's image-conditioned built-ins (Qwen-Image-Edit, -2509 and -2511 with 1 to 3 condition images, FLUX.1
Kontext-dev, Wan2.1 I2V-14B-720P, Wan2.2 I2V-A14B, Wan2.2 TI2V-5B): their tokens count the condition (an edit's condition image joins the sequence), their
released configs build, each traces one engine step through its plan at world size 8 with its condition's inputs
(condition tokens, first-frame channels and 257 CLIP tokens, per-token timesteps), and ``sp-diffusers plan --model
qwen-image-edit ...`` answers as for the others, ``--rl`` included (the iteration fed the condition the trainer's
conditioned adapters build)."""

from __future__ import annotations

import json

import pytest

from sp_diffusers.planner.models import BUILTIN, resolve_model
from sp_diffusers.planner.shapes import build_inputs, workload_from_pixels, workload_from_tokens

COND = (
    "qwen-image-edit",
    "qwen-image-edit-2511",
    "flux.1-kontext-dev",
    "wan2.1-i2v-14b-720p",
    "wan2.2-i2v-a14b",
    "wan2.2-ti2v-5b",
)


def _plan_rl(
    capsys, model: str, *size: str, ulysses: int = 2, lora_rank: int = 32, extra: tuple[str, ...] = ()
) -> dict:
    """``sp-diffusers plan --rl`` at one small layout of 8 GPUs (CI time): its JSON, after the checks every
    built-in answers (one layout, traced with its iteration, and a recommendation); ``extra``: more arguments."""
    from sp_diffusers.cli import main

    argv = ["plan", "--model", model, *size, "--gpus", "8", "--ulysses", str(ulysses), "--ring", "1"]
    argv += ["--activation-checkpointing", "on", "--lora-rank", str(lora_rank), "--batch", "1"]
    argv += ["--rl", "--num-steps", "4", "--trained-steps", "1", "--group-size", "2", "--json", *extra]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (layout,) = out["layouts"]
    assert layout["iteration"] and out["recommended"] is not None
    return out


@pytest.mark.parametrize(
    "model, size, tokens",
    [
        ("qwen-image-edit", (1024, 1024, 1), 2 * 64 * 64),  # 4096 output + 4096 condition tokens
        ("qwen-image-edit-2509", (1024, 1024, 1), 4 * 64 * 64),  # and 3 condition images (the most) by default
        ("qwen-image-edit-2511", (1024, 1024, 1), 4 * 64 * 64),
        ("flux.1-kontext-dev", (1024, 1024, 1), 2 * 64 * 64),
        ("wan2.1-i2v-14b-720p", (720, 1280, 81), 21 * 45 * 80),  # the condition is channels: no more tokens
        ("wan2.2-i2v-a14b", (720, 1280, 81), 21 * 45 * 80),
        ("wan2.2-ti2v-5b", (704, 1280, 121), 31 * 22 * 40),  # Wan2.2's VAE: 16x spatial, patch 2
    ],
)
def test_tokens_count_the_condition(model, size, tokens):
    spec = resolve_model(model)
    work = workload_from_pixels(spec, *size)
    assert work.tokens == tokens
    assert ("condition tokens" in work.describe(spec)) == (spec.condition == "edit")


def test_condition_images_count_each_image_and_are_refused_where_they_do_not_apply(capsys):
    import dataclasses

    from sp_diffusers.cli import main

    spec = resolve_model("qwen-image-edit-2511")
    assert (spec.condition_images, spec.max_condition_images, spec.config["zero_cond_t"]) == (3, 3, True)
    one = workload_from_pixels(dataclasses.replace(spec, condition_images=1), 512, 512)
    assert one.tokens == 2 * 32 * 32 and "1,024 condition tokens" in one.describe(spec)
    for model, images, message in (
        ("qwen-image-edit-2511", 4, "qwen-image-edit-2511 takes 1 to 3; fix: a count in 1..3"),
        ("qwen-image-edit", 2, "qwen-image-edit takes one condition image; fix: a count in 1..1"),
        ("qwen-image", 1, "qwen-image is not an edit model; fix: leave it out"),
    ):
        argv = ["plan", "--model", model, "--height", "512", "--width", "512", "--gpus", "8"]
        assert main([*argv, "--condition-images", str(images)]) == 2
        assert f"--condition-images {images}: {message}" in capsys.readouterr().err


def test_plan_rl_answers_for_multi_image_editing(capsys):
    """Qwen-Image-Edit-2511 with two condition images: the trainer's edit adapter with two condition grids and
    ``zero_cond_t`` (its condition tokens modulated at timestep 0) through the iteration."""
    size = ("--height", "256", "--width", "256", "--condition-images", "2")
    out = _plan_rl(capsys, "qwen-image-edit-2511", *size, ulysses=4)
    assert out["workload"]["tokens"] == 3 * 16 * 16  # the output's 16 x 16 tokens and two images' as many each


def test_the_conditioned_builtins_trace_with_their_condition_at_world_size_8():
    from sp_diffusers.planner.trace import TraceRequest, block_lists, run_trace

    assert set(COND) <= set(BUILTIN) and BUILTIN["wan2.2-i2v-a14b"].experts == 2
    for name in COND:
        spec = BUILTIN[name]
        work = workload_from_tokens(spec, 500, text_len=512 if spec.kind == "wan" else 31)
        blocks = tuple((k, 1) for k in block_lists(spec))
        train, _ = run_trace(TraceRequest(spec, work, 8, ulysses=2, ring=2, blocks=blocks, rollout=False))
        parts = max(train.places.values(), key=lambda p: p["total"])
        assert parts["parameters"] > 0 and parts["activations"] > 0, name
        assert train.flops > 0 and {k for k, _ in train.comm} >= {"sp", "fsdp"}, (name, train.comm)


def test_inputs_carry_each_condition():
    import torch

    from sp_diffusers.tiny import tiny_model

    edit = resolve_model("qwen-image-edit")
    with torch.device("meta"):
        model = tiny_model("qwenimage")
    work = workload_from_tokens(edit, 64, text_len=8)
    inputs = build_inputs(edit, model, work)
    assert inputs["hidden_states"].shape[1] == 128 and len(inputs["img_shapes"][0]) == 2
    ti2v = resolve_model("wan2.2-ti2v-5b")
    with torch.device("meta"):
        wan = tiny_model("wan")
    inputs = build_inputs(ti2v, wan, workload_from_tokens(ti2v, 64, text_len=8))
    assert inputs["timestep"].dim() == 2  # one per token


def test_plan_answers_for_qwen_image_edit(capsys):
    from sp_diffusers.cli import main

    # one layout (CI time): the full table (`--height 1024 --width 1024 --gpus 8`) enumerates 20 in ~2 minutes
    argv = ["plan", "--model", "qwen-image-edit", "--height", "1024", "--width", "1024", "--gpus", "8"]
    argv += ["--ulysses", "8", "--ring", "1", "--activation-checkpointing", "on", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] is not None and "8,192 tokens" in json.dumps(out)


@pytest.mark.parametrize("model", COND)
def test_the_rl_iteration_feeds_each_condition_as_the_trainer_does(model):
    """``plan --rl``'s inputs come from the trainer's own conditioned adapters (edit: the condition image's packed
    tokens after the noisy ones; I2V: the first-frame channels and CLIP tokens; TI2V: per-token timesteps), and a
    tiny model of the family runs them, returning the noisy tokens' shape."""
    import torch

    from sp_diffusers.planner.iteration import iteration_inputs
    from sp_diffusers.tiny import tiny_model
    from sp_diffusers.tiny.specs import tiny_model_config

    spec = resolve_model(model)
    config = dict(tiny_model_config(spec.kind, num_layers=1))
    if spec.kind == "wan":  # the released config's channels and image branch, at tiny width
        config.update(in_channels=spec.config["in_channels"], out_channels=spec.config.get("out_channels", 16))
        if spec.config.get("image_dim"):
            config.update(image_dim=32, added_kv_proj_dim=64)
    tiny = tiny_model(spec.kind, **config)
    work = workload_from_tokens(spec, 64, text_len=512 if spec.kind == "wan" else 8)
    kwargs = iteration_inputs(spec, tiny, work)(2, torch.tensor(500.0))
    out = tiny(**kwargs, return_dict=False)[0]
    if spec.condition == "edit":
        # the output's tokens and each condition image's as many
        assert kwargs["hidden_states"].shape[1] == (1 + spec.condition_images) * work.grid[1] * work.grid[2]
    elif spec.condition == "i2v":
        assert kwargs["hidden_states"].shape[1] == spec.config["in_channels"]
        assert ("encoder_hidden_states_image" in kwargs) == bool(spec.config.get("image_dim"))
    else:
        assert kwargs["timestep"].dim() == 2  # one per video token
    assert out.shape[0] == 2 and torch.isfinite(out).all()


def test_plan_rl_answers_for_a_conditioned_builtin(capsys):
    # Wan2.1 I2V, the condition with the most parts (channels and CLIP tokens)
    size = ("--height", "240", "--width", "416", "--frames", "5")
    # and compiled (this run serves tests/test_plan_compile.py too: one trace fewer in CI)
    compiled = ("--compile", "blocks", "--compile-train-speedup", "1.25")
    out = _plan_rl(capsys, "wan2.1-i2v-14b-720p", *size, ulysses=8, lora_rank=64, extra=compiled)
    assert any("first frame" in note for note in out["notes"])
    from sp_diffusers.planner.hardware import compute_scaled

    best = out["recommended"]
    it = best["iteration"]
    assert (it["compile"], it["compile_speedup"], it["compile_train_speedup"]) == ("blocks", 1.5, 1.25)
    assert best["config_keys"]["train.compile"] == "blocks"
    # the layout's train step is eager; the iteration's 2 micro-steps (2 samples, batch 1, 1 trained step) are it
    # with the compute divided by 1.25 and the communication as it was
    step = {**best["step_terms_seconds"], "total": best["step_seconds"]}
    assert it["seconds"]["train"] == pytest.approx(2 * compute_scaled(step, 1.25)["total"])
    # (this small step is bound by FSDP's collectives, which outlast its compute: compiled, it is no faster)
    assert it["seconds"]["train"] <= 2 * best["step_seconds"]


# the built-ins whose transformer the trainer calls through an adapter of its own, each at one small layout (CI
# time): Z-Image (lists in, a list out), FLUX.2 [klein] (packed tokens, batched 4-axis ids, no guidance embedding)
# and [dev] (with one: the pipeline's default guidance as its input),
# HunyuanVideo-1.5 (zero condition channels, the MLLM stream, one masked glyph row, 729 zero image tokens)
ADAPTED = {
    "z-image-turbo": [],
    "flux.2-klein-4b": [],
    "flux.2-dev": [],
    "hunyuanvideo-1.5": ["--frames", "5"],
}


@pytest.mark.parametrize("model", sorted(ADAPTED))
def test_plan_rl_answers_for_the_adapted_builtins(capsys, model):
    """The RL iteration calls the transformer through the trainer's adapter and reads the velocity as the trainer
    does (``adapter.noisy_output``)."""
    _plan_rl(capsys, model, "--height", "256", "--width", "256", *ADAPTED[model])


def test_plan_rl_answers_for_ltx2(capsys):
    """LTX-2 (video with audio): the trainer's adapter takes one latent tensor of video then audio tokens (9 frames
    at 24 fps: round(9 / 24 x 25) = 9 audio latents, as LTX2Pipeline makes them) and both text streams, and its
    velocity joins the forward's (video, audio) outputs; the plan counts the audio tokens and says so."""
    import torch

    from sp_diffusers.planner.iteration import iteration_inputs
    from sp_diffusers.tiny import tiny_model

    spec = resolve_model("ltx-2")
    work = workload_from_pixels(spec, 256, 256, 9)
    assert work.grid == (2, 8, 8) and work.audio_tokens == 9 and "9 audio tokens" in work.describe(spec)
    assert workload_from_pixels(spec, *spec.default_size).audio_tokens == 126  # 121 frames: 5.04 s x 25
    tiny = tiny_model("ltx2", num_layers=1, in_channels=8, audio_in_channels=8)
    calls = iteration_inputs(spec, tiny, workload_from_pixels(spec, 64, 64, 9, text_len=8))
    kwargs = calls(2, torch.tensor(500.0))
    assert kwargs["hidden_states"].shape == (2, 2 * 2 * 2, 8) and kwargs["audio_hidden_states"].shape == (2, 9, 8)
    assert kwargs["audio_encoder_hidden_states"].shape == kwargs["encoder_hidden_states"].shape
    assert calls.velocity(tiny(**kwargs, return_dict=False)).shape == (2, 8 + 9, 8)

    out = _plan_rl(capsys, "ltx-2", "--height", "256", "--width", "256", "--frames", "9", "--text-len", "128")
    assert any("audio tokens" in note for note in out["notes"])
