"""The trainer's I/O end to end: `sp-diffusers train` (the CLI's main) for several pipeline folders in one process
group, and the trained model's own output (through the engine's checkpoint loading) for the export check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def train_runs(rank: int, world: int, runs: list[tuple[str, list[str], list[int]]]) -> dict[str, list[dict]]:
    """For each (name, argv, iterations): `sp-diffusers train ARGV --iterations N` for each N in turn (a later N
    resumes from the checkpoint of the earlier); rank 0 returns each run's metrics.jsonl."""
    from sp_diffusers.cli import main
    from tests.workers.engine_steps import _quiet

    _quiet()
    out: dict[str, list[dict]] = {}
    for name, argv, iterations in runs:
        for n in iterations:
            assert main([*argv, "--iterations", str(n)]) == 0, name
        if rank == 0:
            run = Path(argv[argv.index("--out-dir") + 1])
            out[name] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return out


def _conditioned(config: Any, model: torch.nn.Module, base: Any, g: torch.Generator) -> tuple[Any, dict[str, Any]]:
    """An image-conditioned run's adapter (as the trainer builds it) and a random condition of its shapes: the
    transformer's inputs then hold condition tokens, CLIP tokens, per-token timesteps as in training."""
    from sp_diffusers.flowgrpo.build import build_text_encoder
    from sp_diffusers.flowgrpo.models.conditioning import conditioned_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import condition_kind

    kind = condition_kind(config)
    if not kind:
        return base, {}
    pipe = build_text_encoder(config, torch.device("cpu")).pipe
    adapter = conditioned_adapter(base, model, kind, pipe, config.model.condition_area)
    if hasattr(adapter, "condition_grids") or hasattr(adapter, "condition_grid"):
        h, w = getattr(adapter, "condition_grid", None) or adapter.condition_grids[0]
        cond = {"condition_latents": torch.randn(2, h * w, adapter.channels, generator=g)}
    else:
        frames = 1 if adapter.expand_timesteps else adapter.frames
        channels = adapter.channels + (0 if adapter.expand_timesteps else pipe.vae_scale_factor_temporal)
        cond = {"condition_latents": torch.randn(2, channels, frames, adapter.height, adapter.width, generator=g)}
        if adapter.image_embeds:
            cond["condition_image_embeds"] = torch.randn(2, 17, model.config.image_dim, generator=g)
    return adapter, {"condition": cond}


def _stacked(out: Any) -> torch.Tensor:
    """A transformer's output as one tensor (Z-Image returns a per-sample list)."""
    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


def reference(run_dir: str, out_file: str, seed: int = 0) -> dict[str, Any]:
    """Fixed inputs for the run's transformer(s) and what the trained model returns on them: each trained expert
    built as the run built it, its checkpoint loaded by the engine's own resume path (one process), and the base
    model's output (to show the training moved it). Saved to ``out_file`` for a process without sp_diffusers."""
    from sp_diffusers.engine import FSDPEngine
    from sp_diffusers.flowgrpo.build import engine_settings
    from sp_diffusers.flowgrpo.io.export import _fresh_model, run_config
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import expert_names

    config = run_config(run_dir)
    config.parallel.ulysses_sequence_parallel_size = 1
    names = expert_names(config)
    trained = list(config.model.experts) or list(names)
    g = torch.Generator().manual_seed(seed)
    outputs, base, inputs = {}, {}, None
    for name in trained:
        model = _fresh_model(config, name)
        if inputs is None:
            c = model.config
            m = config.model
            adapter = build_adapter(
                model, m.image_size, True, m.frames, config.text.max_sequence_length,
                audio_frames=m.audio_frames, frame_rate=m.frame_rate, pipeline=m.pipeline,
            )
            width = (
                getattr(c, "joint_attention_dim", None)
                or getattr(c, "text_dim", None)
                or getattr(c, "text_embed_dim", None)  # HunyuanVideo-1.5's MLLM stream
                or getattr(c, "caption_channels", None)  # LTX-2's video stream
                or c.cap_feat_dim
            )
            embeds = torch.randn(2, config.text.max_sequence_length, width, generator=g)
            pooled = torch.randn(2, c.pooled_projection_dim, generator=g) if hasattr(c, "pooled_projection_dim") else None
            adapter, condition = _conditioned(config, model, adapter, g)
            if hasattr(c, "text_embed_2_dim"):  # HunyuanVideo-1.5's glyph stream, all valid: its embedder trains too
                condition = {**condition, "text_2": (torch.randn(2, 8, c.text_embed_2_dim, generator=g), torch.ones(2, 8))}
            if hasattr(c, "audio_in_channels"):  # LTX-2's audio text stream (the connectors' second output)
                audio_text = torch.randn(2, embeds.shape[1], width, generator=g)
                condition = {**condition, "text_2": (audio_text, torch.ones(2, embeds.shape[1]))}
            latents = torch.randn(adapter.latent_shape(2), generator=g)
            mask = torch.ones(2, embeds.shape[1], dtype=torch.bool)
            inputs = adapter.inputs(latents, torch.tensor(600.0), embeds, mask, pooled, **condition)
            inputs.pop("joint_attention_kwargs", None)  # SD3's text mask, all True here: the same as none
        with torch.no_grad():
            base[name] = _stacked(model(**inputs, return_dict=False)[0])
        engine = FSDPEngine(model, engine_settings(config))
        root = Path(run_dir) / "checkpoints"
        engine.load_checkpoint(root / name if len(names) > 1 else root)
        with torch.no_grad():
            # the first output, as plain diffusers' check reads it (LTX-2: the video, which attends to the audio)
            outputs[name] = _stacked(engine.model(**inputs, return_dict=False)[0]).detach()
    case = {
        "inputs": inputs,
        "outputs": outputs,
        "base": base,
        "class": type(model).__name__.removeprefix("FSDP"),
        "lora": config.lora.enabled,
        "pipeline": config.model.pipeline,
    }
    torch.save(case, out_file)
    return case
