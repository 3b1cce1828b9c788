"""sp-diffusers plan: token counts of the built-in models, one clear error per bad input, the table and the JSON
of a small plan, and every built-in model traced through the engine at world size 8 (fake tensors)."""

from __future__ import annotations

import json

import pytest

from sp_diffusers.planner.models import BUILTIN, PlanError, resolve_model
from sp_diffusers.planner.shapes import workload_from_pixels, workload_from_tokens


@pytest.mark.parametrize(
    "model, size, tokens",
    [
        ("wan2.1-t2v-14b", (720, 1280, 81), 21 * 45 * 80),  # 75,600: the example
        ("wan2.1-t2v-1.3b", (480, 832, 81), 21 * 30 * 52),
        ("qwen-image", (1328, 1328, 1), 83 * 83),
        ("qwen-image", (2048, 2048, 1), 128 * 128),
        ("flux.1-dev", (1024, 1024, 1), 64 * 64),
        ("hunyuanvideo", (720, 1280, 129), 33 * 45 * 80),
        ("hunyuanvideo-1.5", (720, 1280, 121), 31 * 45 * 80),  # VAE 16x, patch 1
        ("sd3.5-large", (1024, 1024, 1), 64 * 64),
        ("ltx-video", (512, 704, 161), 21 * 16 * 22),  # VAE 32x spatial, 8x temporal, patch 1
        ("cogvideox-5b", (480, 720, 49), 13 * 30 * 45),
        ("z-image-turbo", (1024, 1024, 1), 64 * 64),
        ("flux.2-klein-4b", (1024, 1024, 1), 64 * 64),  # AutoencoderKLFlux2 8x, 2 x 2 packed per token
        ("flux.2-dev", (1024, 768, 1), 64 * 48),
    ],
)
def test_tokens_follow_each_family_vae_and_patch(model, size, tokens):
    spec = resolve_model(model)
    assert workload_from_pixels(spec, *size).tokens == tokens


def test_a_token_count_becomes_a_grid_close_to_it():
    spec = resolve_model("wan2.1-t2v-14b")
    for n in (4096, 65536, 200_000):
        assert abs(workload_from_tokens(spec, n).tokens - n) / n < 0.02


def _cli_error(capsys, *argv: str) -> str:
    from sp_diffusers.cli import USAGE_ERROR, main

    assert main(["plan", *argv]) == USAGE_ERROR
    return capsys.readouterr().err


def test_bad_inputs_are_one_clear_error_each(capsys, tmp_path):
    base = ["--height", "720", "--width", "1280", "--frames", "81", "--gpus", "8"]
    wan = ["--model", "wan2.1-t2v-14b"]
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    (tmp_path / "noclass").mkdir()
    (tmp_path / "noclass" / "config.json").write_text('{"num_layers": 2}')
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text('{"_class_name": "AutoencoderKLWan"}')
    cases = [
        # (argv, what the one error must say)
        (["--model", "wan-14b", *base], ["'wan-14b'", "wan2.1-t2v-14b", "known models"]),
        (["--model", str(tmp_path / "pipe"), *base], ["no config.json", "transformer/ subfolder"]),
        (["--model", str(tmp_path / "noclass"), *base], ["no '_class_name'", "save_pretrained"]),
        (["--model", str(tmp_path / "vae"), *base], ["AutoencoderKLWan", "WanTransformer3DModel"]),
        (
            [*wan, *base, "--ulysses", "3"],
            ["--ulysses 3", "does not divide --gpus 8", "40 attention heads", "[1, 2, 4, 8]"],
        ),
        ([*wan, *base, "--ulysses", "16"], ["--ulysses 16", "does not divide --gpus 8", "[1, 2, 4, 8]"]),
        (
            [*wan, *base, "--ulysses", "4", "--ring", "4"],
            ["--ring 4", "16 does not divide --gpus 8", "[1, 2]"],
        ),
        ([*wan, *base[:-1], "0"], ["--gpus 0", "positive integer"]),
        ([*wan, "--height", "0", "--width", "1280", "--gpus", "8"], ["--height=0", "positive integer"]),
        (
            [*wan, "--height", "700", "--width", "1280", "--gpus", "8"],
            ["--height 700", "multiple of 16", "688 or 704"],
        ),
        ([*wan, "--tokens", "-5", "--gpus", "8"], ["--tokens=-5", "positive integer"]),
        (
            [*wan, "--height", "720", "--width", "1280", "--frames", "80", "--gpus", "8"],
            ["--frames 80", "77 or 81"],
        ),
        ([*wan, *base, "--batch", "0"], ["--batch=0", "positive integer"]),
        ([*wan, *base, "--lora-rank", "0"], ["--lora-rank 0", "full fine-tuning"]),
        (
            [*wan, "--gpus", "8"],
            ["--height and --width (or --tokens)", "--height 720 --width 1280 --frames 81"],
        ),
        ([*wan, *base, "--gpu", "v100"], ["--gpu 'v100'", "h100"]),
        ([*wan, *base, "--tflops", "-1"], ["--tflops -1", "positive"]),
    ]
    for argv, needles in cases:
        err = _cli_error(capsys, *argv)
        assert err.count("error:") == 1, (argv, err)
        for needle in needles:
            assert needle in err, (argv, needle, err)


def test_every_builtin_model_builds_from_its_config():
    """The configs are the released checkpoints' (class defaults differ): the installed class accepts each, and
    the block lists have the checkpoint's lengths."""
    from sp_diffusers.planner.trace import block_lists

    expected = {
        "wan2.1-t2v-1.3b": {"blocks": 30},
        "wan2.1-t2v-14b": {"blocks": 40},
        "wan2.2-t2v-a14b": {"blocks": 40},
        "qwen-image": {"transformer_blocks": 60},
        "qwen-image-2512": {"transformer_blocks": 60},
        "flux.1-dev": {"transformer_blocks": 19, "single_transformer_blocks": 38},
        "hunyuanvideo": {"transformer_blocks": 20, "single_transformer_blocks": 40},
        "hunyuanvideo-1.5": {"transformer_blocks": 54},
        "sd3.5-large": {"transformer_blocks": 38},
        "ltx-video": {"transformer_blocks": 28},
        "ltx-2": {"transformer_blocks": 48},
        "cogvideox-5b": {"transformer_blocks": 42},
        "z-image-turbo": {"layers": 30},
        "flux.2-klein-4b": {"transformer_blocks": 5, "single_transformer_blocks": 20},
        "flux.2-dev": {"transformer_blocks": 8, "single_transformer_blocks": 48},
        # image-conditioned (tests/test_plan_cond.py traces them with their condition)
        "qwen-image-edit": {"transformer_blocks": 60},
        "qwen-image-edit-2509": {"transformer_blocks": 60},
        "qwen-image-edit-2511": {"transformer_blocks": 60},
        "flux.1-kontext-dev": {"transformer_blocks": 19, "single_transformer_blocks": 38},
        "wan2.1-i2v-14b-720p": {"blocks": 40},
        "wan2.2-i2v-a14b": {"blocks": 40},
        "wan2.2-ti2v-5b": {"blocks": 30},
    }
    assert set(BUILTIN) == set(expected)
    for name, spec in BUILTIN.items():
        assert block_lists(spec) == expected[name], name
    assert BUILTIN["wan2.2-t2v-a14b"].experts == 2


def test_every_builtin_family_traces_through_the_engine_at_world_size_8():
    """The released configs with one block per list, an uneven micro-batch (1023 tokens), Ulysses 2 x ring 2 x
    dp 2: each family's inputs, plan and engine step run on fake tensors (HunyuanVideo-1.5 selects tokens with
    masks, Qwen-Image keeps RoPE tables outside its buffers), and the step holds parameters, activations and
    sends both kinds of collective. (Wan runs in the table test and the accuracy test.)"""
    from sp_diffusers.planner.trace import TraceRequest, block_lists, run_trace

    families = {spec.kind: spec for spec in BUILTIN.values() if spec.kind != "wan" and not spec.condition}
    assert len(families) == 10
    for kind, spec in families.items():
        work = workload_from_tokens(spec, 1023, text_len=31)
        if kind == "ltx2":  # 9 frames, 9 audio tokens: one per SP rank at least (1023 tokens: 1 frame, 1 audio token)
            work = workload_from_pixels(spec, 352, 288, 9, text_len=31)  # 2 x 11 x 9 = 198 video tokens: uneven
        blocks = tuple((k, 1) for k in block_lists(spec))
        train, _ = run_trace(TraceRequest(spec, work, 8, ulysses=2, ring=2, blocks=blocks, rollout=False))
        parts = max(train.places.values(), key=lambda p: p["total"])
        assert parts["parameters"] > 0 and parts["activations"] > 0, kind
        assert train.flops > 0 and {k for k, _ in train.comm} >= {"sp", "fsdp"}, (kind, train.comm)


def test_the_table_and_the_json_of_a_small_plan(capsys):
    """A narrow real-class model (2 blocks: traced whole) on 4 GPUs with Ulysses fixed at 2: every ring x dp
    that divides the GPUs, checkpointing on and off, the JSON fields docs/planning.md documents, and a
    recommendation that fits."""
    import argparse

    from benchmarks.plan_accuracy import NARROW
    from sp_diffusers.planner.command import add_arguments, plan_to_json, print_table, request_from_args
    from sp_diffusers.planner.planner import make_plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # traced whole, one run per layout: the shortcut has its own test (test_plan_shortcut.py)
    folder = _narrow_folder({**NARROW, "num_layers": 2})
    args = parser.parse_args(
        [
            "--model",
            str(folder),
            "--tokens",
            "2048",
            "--gpus",
            "4",
            "--gpu-memory",
            "1",
            "--reserve",
            "0.5",
            "--workers",
            "1",
            "--lora-rank",
            "4",
        ]
    )
    plan = make_plan(request_from_args(args))
    data = json.loads(json.dumps(plan_to_json(plan, 1.0)))
    layouts = {(p["ulysses"], p["ring"], p["dp"], p["activation_checkpointing"]) for p in data["layouts"]}
    # 2 heads: ulysses 1 or 2; ring fills the rest of 4 GPUs
    assert layouts == {
        (u, r, 4 // (u * r), c) for u in (1, 2) for r in (1, 2, 4) if u * r <= 4 for c in (False, True)
    }
    for p in data["layouts"]:
        assert set(p) >= {
            "ulysses",
            "ring",
            "dp",
            "activation_checkpointing",
            "peak_bytes",
            "parts",
            "fits",
            "step_seconds",
            "rollout_peak_bytes",
            "samples_per_second",
        }
        assert set(p["parts"]) == {"parameters", "gradients", "optimizer", "activations", "buffers"}
        assert sum(p["parts"].values()) == p["peak_bytes"]
        assert p["fits"] == (max(p["peak_bytes"], p["rollout_peak_bytes"]) <= 0.5 * 2**30)
    by = {(p["ring"], p["activation_checkpointing"]): p for p in data["layouts"]}
    # checkpointing trades activations for recomputation; a larger SP degree splits them further
    assert by[(1, True)]["parts"]["activations"] < by[(1, False)]["parts"]["activations"]
    assert by[(2, False)]["parts"]["activations"] < by[(1, False)]["parts"]["activations"]
    assert by[(1, True)]["flops_per_gpu"] > by[(1, False)]["flops_per_gpu"]  # the recomputed forward
    best = data["recommended"]
    assert best["fits"] and best["engine_arguments"]["lora"] == "LoraSettings(rank=4)"
    assert best["samples_per_second"] == max(p["samples_per_second"] for p in data["layouts"] if p["fits"])
    print_table(plan, 1.0)
    out = capsys.readouterr().out
    assert "recommended: ulysses=" in out and "FSDPEngine(model, ulysses_sequence_parallel_size=" in out


def test_forked_workers_plan_what_one_process_plans(capfd):
    """The command's default: traces in worker processes forked from this one. The same plan as traced here, and
    nothing printed (diffusers warned that attention backends are experimental at each model's reset)."""
    import argparse
    import dataclasses

    from benchmarks.plan_accuracy import NARROW
    from sp_diffusers.planner.command import add_arguments, request_from_args
    from sp_diffusers.planner.planner import make_plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    folder = _narrow_folder({**NARROW, "num_layers": 2})  # traced whole: one run per layout
    argv = ["--model", str(folder), "--tokens", "1024", "--gpus", "4", "--ulysses", "2"]
    req = request_from_args(parser.parse_args([*argv, "--ring", "1", "--workers", "2"]))
    forked = make_plan(req)
    here = make_plan(dataclasses.replace(req, workers=1))
    assert [p.to_json() for p in forked.layouts] == [p.to_json() for p in here.layouts]
    assert len(forked.layouts) == 2  # checkpointing off and on
    out, err = capfd.readouterr()
    assert "experimental" not in out + err, err


def _narrow_folder(config: dict):
    """A transformer folder as save_pretrained writes it (config.json only: the planner reads no weights)."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp()) / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", **config}))
    return folder


def test_a_plan_error_is_a_value_error():
    with pytest.raises(PlanError, match="known models"):
        resolve_model("no-such-model")
    assert issubclass(PlanError, ValueError)
