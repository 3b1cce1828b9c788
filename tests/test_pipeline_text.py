"""Prompts through a diffusers pipeline's own text encoders (``text.pipeline``), one process.

A tiny but real ``StableDiffusion3Pipeline`` folder (CLIP-L, CLIP-G, T5, tokenizers, the tiny SD3
transformer; ``sp_diffusers.tiny.save_tiny_sd3_pipeline``) stands in for stable-diffusion-3.5. The SP
step parity of this path is in tests/test_engine.py (``sd3_pipeline``).
"""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_sd3_pipeline

    return save_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3-pipeline"), num_layers=2)


def test_encoder_gives_what_the_pipeline_gives_its_transformer(pipeline_dir):
    from diffusers import StableDiffusion3Pipeline

    from sp_diffusers.flowgrpo.models.text import PipelineTextEncoder

    prompts = ["a red cat", "a blue teapot on a table"]
    encoder = PipelineTextEncoder(str(pipeline_dir), max_sequence_length=16)
    got = encoder.encode_batch(prompts, prefix="negative_")
    pipe = StableDiffusion3Pipeline.from_pretrained(pipeline_dir, transformer=None, vae=None)
    with torch.no_grad():  # as the pipeline's __call__ (with transformers 5.24 the encoders differ in the last bit with autograd)
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=16
        )
    assert embeds.shape == (2, 77 + 16, 32) and pooled.shape == (2, 32)
    assert torch.equal(torch.stack(got["negative_prompt_embeds"]), embeds)
    assert torch.equal(got["negative_pooled_prompt_embeds"], pooled)
    assert all(m.all() and m.shape == (93,) for m in got["negative_prompt_embeds_mask"])  # SD3 sees padding
    assert not torch.equal(pooled[0], pooled[1])
    assert encoder.hidden_size == 32


def test_sd3_adapter_uses_the_encoders_pooled_projection(pipeline_dir):
    from sp_diffusers.flowgrpo.models.adapters import SD3Adapter

    adapter = SD3Adapter(8, 8, 4, 2)
    embeds, mask = torch.randn(2, 5, 32), torch.ones(2, 5, dtype=torch.bool)
    pooled = torch.randn(2, 32)
    latents, sigma = torch.randn(2, 4, 8, 8), torch.tensor(0.5)
    assert adapter.inputs(latents, sigma, embeds, mask, pooled)["pooled_projections"] is pooled
    assert torch.allclose(adapter.inputs(latents, sigma, embeds, mask)["pooled_projections"], embeds.mean(1))


def test_cli_trains_sd3_with_the_pipeline_encoders(pipeline_dir, tmp_path):
    """Two iterations, one process: the config keys reach the trainer, rollouts use the pooled CLIP input."""
    from sp_diffusers.cli import main

    out = tmp_path / "run"
    argv = [
        "train",
        "--config",
        "examples/configs/tiny_sd3_sp2.yaml",
        "--pretrained",
        str(pipeline_dir / "transformer"),
        "--iterations",
        "2",
        "--out-dir",
        str(out),
        "--set",
        f"text.pipeline={pipeline_dir}",
        "--set",
        "text.max_sequence_length=8",
        "--set",
        "parallel.ulysses_sequence_parallel_size=1",
        "--set",
        "flowgrpo.prompts_per_rank=2",
        "--set",
        "train.progress=false",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)


def test_pipeline_errors_name_the_key(tmp_path, pipeline_dir):
    from sp_diffusers.flowgrpo.models.text import PipelineTextEncoder

    with pytest.raises(FileNotFoundError, match=r"text\.pipeline=.*no model_index\.json"):
        PipelineTextEncoder(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ValueError, match=r"is a StableDiffusionPipeline; supported: StableDiffusion3Pipeline"):
        PipelineTextEncoder(str(tmp_path))


def test_text_width_mismatch_names_the_key(tmp_path):
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.kind, c.model.overrides = "sd3", {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1
    c.text.hidden_size = 16  # the tiny SD3's joint_attention_dim is 32
    c.train.out_dir = str(tmp_path)
    with pytest.raises(
        ValueError, match=r"text\.hidden_size: .* 16-wide .* joint_attention_dim is 32; fix: .*=32"
    ):
        FlowGRPOTrainer(c)
