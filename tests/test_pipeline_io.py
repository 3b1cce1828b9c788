"""A pipeline folder in: for each family the trainer reads (Qwen-Image, FLUX.1, SD3, Wan, Z-Image), the pipeline's
own ``__call__`` is run on a tiny pipeline written with ``save_pretrained`` and every transformer call is recorded;
the trainer's parts built from the same folder (text encoder, schedule, adapter) must hand the transformer the same
inputs at the same timesteps. Plus the folder checks (one process)."""

from __future__ import annotations

import inspect

import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig

FAMILIES = ("qwenimage", "flux", "sd3", "wan", "zimage")
PROMPTS = ["a red cat", "a blue teapot on a table"]  # different lengths: ragged text
# Qwen-Image's template leaves ~130 characters before the prompt (character tokenizer): keep them all; Z-Image's
# chat template ~50
TEXT_LEN = {"qwenimage": 256, "flux": 16, "sd3": 16, "wan": 16, "zimage": 128}
# the inputs every call must carry, by the forward's parameter names (Z-Image's pipeline passes them by position)
REQUIRED = {"zimage": {"x", "t", "cap_feats"}}
DEFAULT_REQUIRED = {"hidden_states", "timestep", "encoder_hidden_states"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    root = tmp_path_factory.mktemp("pipes")
    return {f: save_tiny_pipeline(f, root / f, num_layers=1) for f in (*FAMILIES, "wan2.2")}


def _record(pipe, family, guidance_scale: float | None = None):
    """Every transformer call's inputs by parameter name, the scheduler's timesteps, the pipeline's final latents."""
    calls = []
    names = list(inspect.signature(pipe.transformer.forward).parameters)

    def record(module, args, kwargs):
        calls.append({**dict(zip(names[: len(args)], args, strict=True)), **kwargs})  # positionals by name

    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    timesteps = []
    # a copy: ZImagePipeline writes each prompt's chat template back into the list it is given
    kwargs = dict(prompt=list(PROMPTS), num_inference_steps=3, height=16, width=32, output_type="latent")  # not square
    kwargs["callback_on_step_end"] = lambda p, i, t, k: timesteps.append(float(t)) or {}
    kwargs.update(max_sequence_length=TEXT_LEN[family])
    if family == "wan":
        kwargs.update(num_frames=3, guidance_scale=1.0)
    elif family == "sd3":
        kwargs.update(guidance_scale=1.0)
    elif family == "zimage":  # Z-Image-Turbo's setting: no CFG (the pipeline's guidance runs for any g > 0)
        kwargs.update(guidance_scale=0.0 if guidance_scale is None else guidance_scale)
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(0))
    hook.remove()
    return calls, timesteps, out[0]


def _assert_same(got, want, what: str) -> None:
    """Equal values: Z-Image's per-sample lists element by element."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), what
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            # exact: the same latents, the scheduler's own float32 timesteps, the same encoder on the same batch
            assert g.shape == w.shape and torch.equal(g.to(w.dtype), w), f"{what}[{k}]"
        return
    torch.testing.assert_close(got.to(want.dtype), want, atol=1e-5, rtol=0, msg=what)


def _latents_of(call, family):
    """The pipeline's latents at a recorded call, in the trainer's layout."""
    if family == "zimage":  # a per-sample list of [C, 1, H, W] -> [B, C, H, W]
        return torch.stack(call["x"]).squeeze(2)
    return call["hidden_states"]


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_parts_give_the_transformer_what_the_pipeline_gives_it(folders, family):
    from diffusers import DiffusionPipeline

    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline
    from sp_diffusers.parallel.padding import pad_text_batch

    pipe = DiffusionPipeline.from_pretrained(folders[family])
    pipe.set_progress_bar_config(disable=True)
    calls, timesteps, _ = _record(pipe, family)

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width, c.model.frames = str(folders[family]), 8, 16, 2
    c.text.max_sequence_length, c.flowgrpo.num_steps = TEXT_LEN[family], 3
    assert resolve_pipeline(c) == family and c.model.kind == family
    model = load_transformers(c)["transformer"]
    adapter = build_adapter(model, 8, True, 2, TEXT_LEN[family], image_width=16)
    schedule = run_schedule(c, adapter)
    assert schedule.timesteps.tolist() == pytest.approx(timesteps, abs=1e-4)  # float32 of the same scheduler

    text = build_text_encoder(c, torch.device("cpu")).encode_batch(PROMPTS)
    # Z-Image: padded as the engine pads for SP 4, which the adapter must cut back to each prompt's tokens
    degree = 4 if family == "zimage" else 1
    embeds, mask = pad_text_batch(text["prompt_embeds"], text["prompt_embeds_mask"], degree, "prompt_embeds")
    for i, call in enumerate(calls):
        latents = _latents_of(call, family)
        ours = adapter.inputs(latents, schedule.timesteps[i], embeds, mask, text.get("pooled_prompt_embeds"))
        shared = set(ours) & set(call)
        assert REQUIRED.get(family, DEFAULT_REQUIRED) <= shared
        for key in shared:
            want, got = call[key], ours[key]
            if key == "encoder_hidden_states_mask" and want is None:  # the pipeline drops an all-True mask
                want = torch.ones_like(got)
            if key == "joint_attention_kwargs" and want is None:  # SD3: our text mask, all True here = no mask
                assert got["encoder_hidden_states_mask"].all()
                continue
            if isinstance(want, list) and want and all(torch.is_tensor(w) for w in want):  # Z-Image's lists
                _assert_same(got, want, f"{family} step {i}: {key}")
                continue
            if not torch.is_tensor(got):  # img_shapes, txt_seq_lens
                assert got == want, f"{family} step {i}: {key}"
                continue
            assert want is not None, key
            _assert_same(got, want, f"{family} step {i}: {key}")
        if family == "flux":
            assert call["guidance"] is not None and "guidance" in ours  # FLUX.1-dev's embedded guidance (3.5)


class _Engine:
    """The model as the trainer's engine hands it to the sampler (one process, no SP)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def for_step(self, step: int) -> _Engine:
        return self

    def forward(self, **inputs):
        return self.model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_zimage_sampler_steps_as_the_pipeline_steps(folders, guidance):
    """The velocity's sign, scale and guidance: from the pipeline's latents at each step, one deterministic step of
    the trainer's sampler (the engine's output through the adapter: stacked, frame dropped, negated; then Euler)
    lands on the pipeline's next latents, the last one on its output. g = 0: Z-Image-Turbo's setting, no CFG; g = 2:
    the pipeline's CFG ``pos + g (pos - neg)`` with the empty negative prompt against ``flowgrpo.cfg_scale = 1 + g``
    (``neg + s (pos - neg)``), the same numbers in another order of operations."""
    from diffusers import DiffusionPipeline

    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler
    from sp_diffusers.flowgrpo.sampling.sde import ode_step
    from sp_diffusers.parallel.padding import pad_text_batch

    pipe = DiffusionPipeline.from_pretrained(folders["zimage"])
    pipe.set_progress_bar_config(disable=True)
    calls, _, final = _record(pipe, "zimage", guidance)

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width = str(folders["zimage"]), 8, 16
    c.text.max_sequence_length, c.flowgrpo.num_steps, c.flowgrpo.cfg_scale = TEXT_LEN["zimage"], 3, 1.0 + guidance
    resolve_pipeline(c)
    model = load_transformers(c)["transformer"]
    adapter = build_adapter(model, 8, True, 1, TEXT_LEN["zimage"], image_width=16)
    schedule = run_schedule(c, adapter)
    encoder = build_text_encoder(c, torch.device("cpu"))
    assert encoder.hidden_size == model.config.cap_feat_dim == 32
    cond: dict = {}
    for prefix, prompts in (("", PROMPTS), ("negative_", [""] * len(PROMPTS))):
        text = encoder.encode_batch(prompts, prefix=prefix)
        key = f"{prefix}prompt_embeds"
        cond[key], cond[key + "_mask"] = pad_text_batch(text[key], text[key + "_mask"], 2, key)
    sampler = Sampler(_Engine(model), adapter, schedule, cfg_scale=c.flowgrpo.cfg_scale)
    batch = len(PROMPTS)
    assert len(calls) == schedule.num_steps and len(calls[0]["x"]) == (2 * batch if guidance else batch)
    sigmas = schedule.sigmas.tolist()
    for i in range(schedule.num_steps):
        x = torch.stack(calls[i]["x"][:batch]).squeeze(2)  # with CFG the call carries [pos, neg]
        with torch.no_grad():
            v = sampler.velocity(sampler.engine_at(i), x, schedule.timesteps[i], cond)
        ours = ode_step(x, v, sigmas[i], sigmas[i + 1])
        want = torch.stack(calls[i + 1]["x"][:batch]).squeeze(2) if i + 1 < len(calls) else final
        if guidance:  # the guidance's arithmetic in another order: rounding only (6e-8 seen, latents up to ~40)
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=0, msg=f"step {i}")
        else:  # the same forward, negation and Euler step: bit for bit
            assert torch.equal(ours, want), f"step {i}: {(ours - want).abs().max()}"


def test_text_encoders_match_encode_prompt(folders):
    from diffusers import FluxPipeline, QwenImagePipeline

    from sp_diffusers.flowgrpo.models.text import PipelineTextEncoder

    q = PipelineTextEncoder(str(folders["qwenimage"]), 256)
    got = q.encode_batch(PROMPTS)
    # the references run as the pipelines' __call__ runs them, without autograd: with transformers 5.24 the same
    # encoder differs in the last bit with and without it (6e-7, Flux's T5), and PipelineTextEncoder encodes without
    with torch.no_grad():
        ref, mask = QwenImagePipeline.from_pretrained(folders["qwenimage"], transformer=None, vae=None).encode_prompt(
            PROMPTS, max_sequence_length=256
        )
    lengths = [int(m.sum()) for m in mask]
    assert [e.shape[0] for e in got["prompt_embeds"]] == lengths and lengths[0] != lengths[1]  # ragged
    for e, r, n in zip(got["prompt_embeds"], ref, lengths, strict=True):
        assert torch.equal(e, r[:n])
    assert q.hidden_size == 32
    f = PipelineTextEncoder(str(folders["flux"]), 16)
    got = f.encode_batch(PROMPTS, prefix="negative_")
    with torch.no_grad():
        embeds, pooled, _ = FluxPipeline.from_pretrained(folders["flux"], transformer=None, vae=None).encode_prompt(
            PROMPTS, None, max_sequence_length=16
        )
    assert torch.equal(torch.stack(got["negative_prompt_embeds"]), embeds)
    assert torch.equal(got["negative_pooled_prompt_embeds"], pooled) and f.hidden_size == 32


def test_folder_checks(folders, tmp_path):
    from sp_diffusers.flowgrpo.models.pipeline_io import boundary_ratio, expert_names, resolve_pipeline

    c = TrainConfig()
    c.model.pipeline = str(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.pipeline=.* has no model_index\.json"):
        resolve_pipeline(c)
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "U"]}')
    with pytest.raises(ConfigError, match=r"is a StableDiffusionPipeline; the trainer reads QwenImagePipeline"):
        resolve_pipeline(c)
    c.model.pretrained = "x"
    with pytest.raises(ConfigError, match=r"model\.pipeline=.* and model\.pretrained=.* both name the weights"):
        resolve_pipeline(c)
    c = TrainConfig()
    c.model.pipeline = str(folders["wan2.2"])
    assert resolve_pipeline(c) == "wan"
    assert expert_names(c) == ("transformer", "transformer_2") and boundary_ratio(c) == 0.875
    c.model.pipeline = str(folders["wan"])
    assert expert_names(c) == ("transformer",) and boundary_ratio(c) is None


def test_tiny_writers_refuse_a_folder_without_weights(tmp_path, monkeypatch):
    """From transformers 5.15, ``save_pretrained`` writes a model's weights only on rank 0 of an initialised process
    group. A tiny pipeline (or CLIP) written on another rank must fail there, naming the folder and the fix, not on
    load, where its peers see only a closed connection. Rank 1 is simulated; below 5.15 the wrapper applies the
    same rule (a no-op where transformers already applies it)."""
    from pathlib import Path

    import torch.distributed as dist
    from transformers import PreTrainedModel

    from sp_diffusers.tiny import save_tiny_clip, save_tiny_sd3_pipeline

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    save = PreTrainedModel.save_pretrained

    def rank0_writes_weights(self, folder, *args, **kwargs):
        save(self, folder, *args, **kwargs)
        for f in Path(folder).glob("*.safetensors"):
            f.unlink()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", rank0_writes_weights)
    fix = r"rank 1 of a process group, and transformers >= 5.15 .*; fix: write the folder once, on one process"
    with pytest.raises(RuntimeError, match=r"save_tiny_pipeline \(StableDiffusion3Pipeline\): no weights .*" + fix) as e:
        save_tiny_sd3_pipeline(tmp_path / "sd3", num_layers=1)
    listed = str(e.value).split("no weights written in ")[1].split(" (")[0].split(", ")
    assert listed == [str(tmp_path / "sd3" / name) for name in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    with pytest.raises(RuntimeError, match=r"save_tiny_clip: no weights written in .*clip .*" + fix):
        save_tiny_clip(tmp_path / "clip")


def test_wan22_experts_switch_where_the_pipeline_switches(folders):
    from diffusers import WanPipeline

    from sp_diffusers.engine import FSDPEngine
    from sp_diffusers.flowgrpo.algorithms.registry import algorithm_for
    from sp_diffusers.flowgrpo.batch import IterationBatch
    from sp_diffusers.flowgrpo.build import run_schedule
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.experts import (
        ExpertEngines,
        build_engines,
        check_expert_steps,
    )
    from sp_diffusers.flowgrpo.models.pipeline_io import resolve_pipeline

    pipe = WanPipeline.from_pretrained(folders["wan2.2"])
    pipe.set_progress_bar_config(disable=True)
    order: list[str] = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(lambda m, a, kw, n=name: order.append(n), with_kwargs=True)
    pipe(
        prompt=PROMPTS[:1],
        num_inference_steps=6,
        height=16,
        width=16,
        num_frames=3,
        guidance_scale=1.0,
        max_sequence_length=16,
        output_type="latent",
    )
    assert set(order) == {"transformer", "transformer_2"}

    c = TrainConfig()
    c.model.pipeline, c.model.frames, c.flowgrpo.num_steps = str(folders["wan2.2"]), 2, 6
    c.parallel.ulysses_sequence_parallel_size, c.flowgrpo.window_range = 1, [0, 5]
    resolve_pipeline(c)
    engines = build_engines(c, None, FSDPEngine)
    assert isinstance(engines, ExpertEngines) and set(engines.trained) == {"transformer", "transformer_2"}
    engines.bind_schedule(run_schedule(c, build_adapter(engines.model, 8, True, 2, 16)).timesteps)
    assert engines.route == order  # WanPipeline: timestep >= 0.875 x 1000 -> transformer, else transformer_2

    # the window start is drawn from the iteration's seed alone (every dp rank alike), over trained steps only
    batch = IterationBatch(["x"] * 2, {}, torch.arange(2), torch.zeros(2))
    algorithm = algorithm_for(c)
    algorithm.share_plan(batch, set(engines.trainable_steps()), torch.Generator().manual_seed(5))
    again = IterationBatch(["x"] * 2, {}, torch.arange(2), torch.zeros(2))
    algorithm.share_plan(again, set(engines.trainable_steps()), torch.Generator().manual_seed(5))
    assert batch.plan.window_start == again.plan.window_start

    c.model.experts = ["transformer_2"]
    low_only = build_engines(c, None, FSDPEngine)
    low_only.bind_schedule(torch.tensor([999.0, 900.0, 500.0, 100.0]))
    frozen = low_only.experts["transformer"]
    assert frozen.settings.frozen and frozen.optimizer is None and list(low_only.trained) == ["transformer_2"]
    assert low_only.trainable_steps() == [2, 3]
    assert not any(p.requires_grad for p in low_only.experts["transformer"].model.parameters())
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 4, 2, [0, 2]
    # DanceGRPO with two experts: one subset of the trained expert's steps for the whole batch (never the last)
    c.flowgrpo.algorithm, c.flowgrpo.timestep_fraction = "dance_grpo", 0.6
    dance = IterationBatch(["x"] * 3, {}, torch.arange(3), torch.zeros(3))
    algorithm_for(c).share_plan(dance, set(low_only.trainable_steps()), torch.Generator().manual_seed(1))
    assert dance.plan.host_steps == [2] and dance.plan.train_steps.tolist() == [[2]] * 3
    c.flowgrpo.algorithm = "flow_grpo"
    with pytest.raises(ConfigError, match=r"no trainable window .* fix: flowgrpo\.window_range=\[2, 3\]"):
        check_expert_steps(low_only, algorithm_for(c))
    c.model.experts = ["transformer_3"]
    with pytest.raises(
        ConfigError, match=r"model\.experts=\['transformer_3'\]: the pipeline's transformers are"
    ):
        build_engines(c, None, FSDPEngine)
