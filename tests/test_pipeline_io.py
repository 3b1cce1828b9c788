"""A pipeline folder in: for each family the trainer reads (Qwen-Image, FLUX.1, SD3, Wan, Z-Image, FLUX.2 [klein] and [dev]), the
pipeline's
own ``__call__`` is run on a tiny pipeline written with ``save_pretrained`` and every transformer call is recorded;
the trainer's parts built from the same folder (text encoder, schedule, adapter) must hand the transformer the same
inputs at the same timesteps. Plus the folder checks (one process)."""

from __future__ import annotations

import inspect
import json
import warnings

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig

from ._engine import OneProcessEngine

FAMILIES = ("qwenimage", "flux", "sd3", "wan", "zimage", "flux2-klein", "flux2-dev")
KIND = {"flux2-klein": "flux2", "flux2-dev": "flux2"}  # tiny pipeline name -> model.kind, where they differ
PROMPTS = ["a red cat", "a blue teapot on a table"]  # different lengths: ragged text
# Qwen-Image's template leaves ~130 characters before the prompt (character tokenizer): keep them all; Z-Image's
# chat template ~50; FLUX.2 [klein]'s (the empty think block added) ~50 more than the prompt, every row seen; FLUX.2
# [dev]'s tiny template 5 tokens (its system message and markers are one token each)
TEXT_LEN = {"qwenimage": 256, "flux": 16, "sd3": 16, "wan": 16, "zimage": 128, "flux2-klein": 96, "flux2-dev": 32}
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
    elif family == "flux2-klein":  # no CFG (the distilled [klein]'s setting; Base guides at g > 1)
        kwargs.update(guidance_scale=1.0 if guidance_scale is None else guidance_scale)
    elif family == "flux2-dev":  # guidance-distilled: its guidance_scale is the transformer's input (default 4)
        kwargs.update(guidance_scale=4.0 if guidance_scale is None else guidance_scale)
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
    assert resolve_pipeline(c) == KIND.get(family, family) and c.model.kind == KIND.get(family, family)
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
        if family == "flux2-klein":  # no guidance embedding: none passed; 4-axis ids, batched, as the pipeline's
            assert call["guidance"] is None and "guidance" not in ours
            assert ours["img_ids"].shape == (len(PROMPTS), 4 * 8, 4) and ours["txt_ids"].shape[-1] == 4
        if family == "flux2-dev":  # the guidance embedding's input: the pipeline's default 4, which the adapter takes
            assert torch.equal(call["guidance"], torch.full((len(PROMPTS),), 4.0)) and "guidance" in shared


@pytest.mark.parametrize(
    ("family", "guidance"),
    [("zimage", 0.0), ("zimage", 2.0), ("flux2-klein", 1.0), ("flux2-klein", 4.0), ("flux2-dev", 2.5)],
)
def test_sampler_steps_as_the_pipeline_steps(folders, family, guidance):
    """The velocity's sign, scale and guidance: from the pipeline's latents at each step, one deterministic step of
    the trainer's sampler (the engine's output through the adapter, then Euler) lands on the pipeline's next
    latents, the last one on its output (FLUX.2: through the adapter's ``to_vae``, the VAE's batch-norm statistics
    undone and the patches unpacked, as the pipeline returns ``output_type="latent"``).

    Z-Image: its output stacked, frame dropped, negated; g = 0 is Z-Image-Turbo's setting, no CFG; g = 2 is the
    pipeline's ``pos + g (pos - neg)`` with the empty negative prompt against ``flowgrpo.cfg_scale = 1 + g``
    (``neg + s (pos - neg)``). FLUX.2 [klein]: the output is the velocity; g = 1 runs no CFG (as the distilled
    [klein] at any g); g = 4 (Base's default) is ``neg + g (pos - neg)`` over two forwards, so ``cfg_scale = g``:
    with ``cfg_batch`` off the sampler makes the same two calls, bit for bit. FLUX.2 [dev]: no CFG, g is the
    guidance embedding's input (``flowgrpo.guidance_scale``). Z-Image's CFG meets the same numbers in another order:
    rounding only."""
    from diffusers import DiffusionPipeline

    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler
    from sp_diffusers.flowgrpo.sampling.sde import ode_step
    from sp_diffusers.parallel.padding import pad_text_batch

    pipe = DiffusionPipeline.from_pretrained(folders[family])
    pipe.set_progress_bar_config(disable=True)
    calls, _, final = _record(pipe, family, guidance)

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width = str(folders[family]), 8, 16
    # Z-Image's g on top of 1; [klein]'s g is s; [dev] runs no CFG (its g is the guidance embedding's)
    scale = {"zimage": 1.0 + guidance, "flux2-dev": 1.0}.get(family, guidance)
    c.text.max_sequence_length, c.flowgrpo.num_steps, c.flowgrpo.cfg_scale = TEXT_LEN[family], 3, scale
    c.flowgrpo.guidance_scale = guidance if family == "flux2-dev" else 0.0
    resolve_pipeline(c)
    model = load_transformers(c)["transformer"]
    adapter = build_adapter(
        model, 8, True, 1, TEXT_LEN[family], c.flowgrpo.guidance_scale, image_width=16, pipeline=c.model.pipeline
    )
    schedule = run_schedule(c, adapter)
    encoder = build_text_encoder(c, torch.device("cpu"))
    width = model.config.cap_feat_dim if family == "zimage" else model.config.joint_attention_dim
    assert encoder.hidden_size == width
    cond: dict = {}
    for prefix, prompts in (("", PROMPTS), ("negative_", [""] * len(PROMPTS))):
        text = encoder.encode_batch(prompts, prefix=prefix)
        key = f"{prefix}prompt_embeds"
        cond[key], cond[key + "_mask"] = pad_text_batch(text[key], text[key + "_mask"], 2, key)
    # Z-Image batches both branches in one call; FLUX.2 [klein] calls its transformer once per branch, and so does
    # the sampler here (rollout.cfg_batch false): the same forwards and the same guidance formula, bit for bit
    two_calls = family != "zimage"
    sampler = Sampler(OneProcessEngine(model), adapter, schedule, cfg_scale=c.flowgrpo.cfg_scale, cfg_batch=not two_calls)
    batch, guided = len(PROMPTS), scale > 1.0
    per_step = 2 if guided and two_calls else 1
    assert len(calls) == per_step * schedule.num_steps
    assert _latents_of(calls[0], family).shape[0] == (2 * batch if guided and family == "zimage" else batch)
    sigmas = schedule.sigmas.tolist()
    for i in range(schedule.num_steps):
        x = _latents_of(calls[per_step * i], family)[:batch]  # with Z-Image's CFG the call carries [pos, neg]
        with torch.no_grad():
            v = sampler.velocity(sampler.engine_at(i), x, schedule.timesteps[i], cond)
        ours = ode_step(x, v, sigmas[i], sigmas[i + 1])
        if i + 1 < schedule.num_steps:
            want = _latents_of(calls[per_step * (i + 1)], family)[:batch]
        else:  # the pipeline's output: FLUX.2 [klein] returns the VAE's latents, [dev] its tokens, Z-Image its own
            want = final
            ours = adapter.to_vae(pipe.vae, ours) if family == "flux2-klein" else ours
        if guided and family == "zimage":  # the guidance in another order: rounding only (6e-8 seen, latents ~40)
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")
        else:  # the same forwards, guidance, velocity and Euler step: bit for bit
            assert torch.equal(ours, want), f"step {i}: {(ours - want).abs().max()}"


def test_text_encoders_match_encode_prompt(folders):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline, FluxPipeline, QwenImagePipeline

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
    k = PipelineTextEncoder(str(folders["flux2-klein"]), TEXT_LEN["flux2-klein"])
    got = k.encode_batch(PROMPTS)
    with torch.no_grad():
        embeds, text_ids = Flux2KleinPipeline.from_pretrained(
            folders["flux2-klein"], transformer=None, vae=None
        ).encode_prompt(PROMPTS, max_sequence_length=TEXT_LEN["flux2-klein"])
    # every row (padding included: the transformer sees them all), 3 stacked Qwen3 layers side by side
    assert torch.equal(torch.stack(got["prompt_embeds"]), embeds) and all(m.all() for m in got["prompt_embeds_mask"])
    assert k.hidden_size == 3 * 16 == embeds.shape[-1] and text_ids.shape == (2, TEXT_LEN["flux2-klein"], 4)
    with pytest.warns(UserWarning, match=r"PipelineTextEncoder \(Flux2KleinPipeline\): the prompt .* tokens, more"):
        k.encode_batch(["a very long prompt " * 4])
    # FLUX.2 [dev]: Mistral3's hidden states 10, 20 and 30 after the pipeline's system message
    d = PipelineTextEncoder(str(folders["flux2-dev"]), TEXT_LEN["flux2-dev"])
    got = d.encode_batch(PROMPTS)
    with torch.no_grad():
        pipe = Flux2Pipeline.from_pretrained(folders["flux2-dev"], transformer=None, vae=None)
        embeds, text_ids = pipe.encode_prompt(PROMPTS, max_sequence_length=TEXT_LEN["flux2-dev"])
    assert torch.equal(torch.stack(got["prompt_embeds"]), embeds) and all(m.all() for m in got["prompt_embeds_mask"])
    assert d.hidden_size == 3 * 16 == embeds.shape[-1] and text_ids.shape == (2, TEXT_LEN["flux2-dev"], 4)
    with pytest.warns(UserWarning, match=r"PipelineTextEncoder \(Flux2Pipeline\): the prompt .* 33 tokens, more"):
        d.encode_batch(["x" * 28])  # 28 characters + 5 template tokens: one more than 32
    with warnings.catch_warnings():  # exactly 32 tokens: no warning
        warnings.simplefilter("error")
        d.encode_batch(["x" * 27])


def test_flux2_pixels_decode_and_encode_as_the_pipeline_does(folders):
    """FLUX.2's latents are normalised by its VAE's batch-norm statistics over the packed channels: the decoder
    (the adapter's ``to_vae``) gives the pixels the pipeline's own ``__call__`` gives, and the encoder (``from_vae``)
    the tokens of the pipeline's ``_encode_vae_image`` (the posterior's mode, patchified, normalised) and packing."""
    from diffusers import Flux2KleinPipeline

    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.decode import PixelDecoder, PixelEncoder

    pipe = Flux2KleinPipeline.from_pretrained(folders["flux2-klein"])
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae.bn.running_mean.abs().sum() > 0  # the tiny VAE's statistics are not the identity
    kwargs = dict(prompt=PROMPTS, num_inference_steps=2, height=16, width=32, guidance_scale=1.0)
    kwargs.update(max_sequence_length=TEXT_LEN["flux2-klein"])
    tokens: list[torch.Tensor] = []

    def keep(p, i, t, k):  # the last step's latents: the tokens the pipeline then unpacks and decodes
        tokens.append(k["latents"])
        return {}

    pixels = pipe(**kwargs, output_type="pt", generator=torch.Generator().manual_seed(3), callback_on_step_end=keep)
    adapter = build_adapter(pipe.transformer, 8, True, 1, TEXT_LEN["flux2-klein"], image_width=16)
    ours = PixelDecoder(pipe.vae, adapter, "cpu")(tokens[-1])
    torch.testing.assert_close(ours, pixels.images, atol=1e-6, rtol=0)  # one float32 path

    images = torch.rand(3, 3, 16, 32, generator=torch.Generator().manual_seed(0))
    encoded = PixelEncoder(pipe.vae, adapter, "cpu")(images)
    with torch.no_grad():
        theirs = pipe._pack_latents(pipe._encode_vae_image(images * 2 - 1, generator=None))
    assert encoded.shape == adapter.latent_shape(3) == theirs.shape
    torch.testing.assert_close(encoded, theirs, atol=1e-6, rtol=0)  # the same ops


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
    # a step-distilled FLUX.2 [klein] samples without CFG: guided rollouts are refused, unguided ones read it
    distilled = tmp_path / "klein-distilled"
    distilled.mkdir()
    for entry in folders["flux2-klein"].iterdir():
        (distilled / entry.name).symlink_to(entry)
    index = json.loads((folders["flux2-klein"] / "model_index.json").read_text())
    (distilled / "model_index.json").unlink()
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    c = TrainConfig()
    c.model.pipeline, c.flowgrpo.cfg_scale = str(distilled), 4.0
    with pytest.raises(ConfigError, match=r"flowgrpo\.cfg_scale=4 but .* step-distilled Flux2KleinPipeline .* fix: "):
        resolve_pipeline(c)
    c.flowgrpo.cfg_scale = 1.0
    assert resolve_pipeline(c) == "flux2"
    # FLUX.2 [dev] is guidance-distilled: its pipeline runs no CFG, so guided rollouts are refused too
    c = TrainConfig()
    c.model.pipeline, c.flowgrpo.cfg_scale = str(folders["flux2-dev"]), 2.0
    with pytest.raises(ConfigError, match=r"flowgrpo\.cfg_scale=2 but .* Flux2Pipeline .* fix: flowgrpo\.cfg_scale=1 and"):
        resolve_pipeline(c)
    c.flowgrpo.cfg_scale = 1.0
    assert resolve_pipeline(c) == "flux2"


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


# HunyuanVideo-1.5: its __call__ takes no max_sequence_length nor step callback, so it is recorded on its own. One
# prompt with quoted text (the byT5 glyph stream), one without (that stream all masked); 5 frames -> 3 latent frames.
HV_PROMPTS = ["a red cat", 'a sign saying "OPEN" on a door']


@pytest.fixture(scope="module")
def hv_folder(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    return save_tiny_pipeline("hunyuanvideo15", tmp_path_factory.mktemp("hv") / "hv", num_layers=1)


def _hv_record(folder, guidance: float, steps: int = 3):
    """The pipeline at ``guidance`` (its guider's scale; 1: no CFG): every transformer call, its timesteps, output."""
    from diffusers import ClassifierFreeGuidance, DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance)
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
    kwargs = dict(prompt=HV_PROMPTS, num_inference_steps=steps, height=16, width=32, num_frames=5)
    out = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    hook.remove()
    return pipe, calls, pipe.scheduler.timesteps.tolist(), out


def _hv_parts(folder, cfg_scale: float = 1.0):
    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width, c.model.frames = str(folder), 8, 16, 3
    c.flowgrpo.num_steps, c.flowgrpo.cfg_scale = 3, cfg_scale
    assert resolve_pipeline(c) == "hunyuanvideo15" and c.model.kind == "hunyuanvideo15"
    model = load_transformers(c)["transformer"]
    adapter = build_adapter(model, 8, True, 3, 256, image_width=16)
    return c, model, adapter, run_schedule(c, adapter), build_text_encoder(c, torch.device("cpu"))


def _hv_text(encoder, prompts, prefix: str, degree: int) -> dict:
    """Both text streams padded as the engine pads them for SP ``degree``."""
    from sp_diffusers.parallel.padding import pad_text_batch

    text = encoder.encode_batch(prompts, prefix=prefix)
    out = {}
    for suffix in ("", "_2"):
        key, mask = f"{prefix}prompt_embeds{suffix}", f"{prefix}prompt_embeds_mask{suffix}"
        out[key], out[mask] = pad_text_batch(text[key], text[mask], degree, key)
    return out


def test_hunyuanvideo15_inputs_as_the_pipeline(hv_folder):
    """The trainer's parts give HunyuanVideo-1.5's transformer what ``HunyuanVideo15Pipeline`` gives it: the same
    timesteps; latents with the zero condition latents and mask channels, the timestep and the zero image stream bit
    for bit; each text stream's valid rows bit for bit (the pipeline pads the MLLM stream to 1000 rows and the byT5
    one to 256, the trainer keeps the valid rows and the engine pads to the SP degree, masked): the masked rows never
    reach the output, so the velocity equals the pipeline's call to rounding (the attention's length differs)."""
    _, calls, timesteps, _ = _hv_record(hv_folder, 1.0)
    _, model, adapter, schedule, encoder = _hv_parts(hv_folder)
    assert schedule.timesteps.tolist() == pytest.approx(timesteps, abs=1e-4)
    assert encoder.hidden_size == model.config.text_embed_dim and len(calls) == 3
    text = _hv_text(encoder, HV_PROMPTS, "", 4)
    channels = adapter.channels
    for i, call in enumerate(calls):
        latents = call["hidden_states"][:, :channels]
        ours = adapter.inputs(
            latents, schedule.timesteps[i], text["prompt_embeds"], text["prompt_embeds_mask"],
            text_2=(text["prompt_embeds_2"], text["prompt_embeds_mask_2"]),
        )
        assert set(ours) == set(call) - {"attention_kwargs", "return_dict"}
        for key in ("hidden_states", "timestep", "image_embeds"):
            assert torch.equal(ours[key], call[key]), f"step {i}: {key}"
        for suffix, limit in (("", 1000), ("_2", 256)):
            want_e, want_m = call[f"encoder_hidden_states{suffix}"], call[f"encoder_attention_mask{suffix}"]
            got_e, got_m = ours[f"encoder_hidden_states{suffix}"], ours[f"encoder_attention_mask{suffix}"]
            assert want_e.shape[1] == limit and got_m.dtype == want_m.dtype and got_e.shape[1] % 4 == 0
            for b in range(len(HV_PROMPTS)):
                keep_w, keep_g = want_m[b].bool(), got_m[b].bool()
                assert int(keep_w.sum()) == int(keep_g.sum()), f"step {i}: stream{suffix} sample {b}"
                assert torch.equal(got_e[b][keep_g], want_e[b][keep_w]), f"step {i}: stream{suffix} sample {b}"
        # the glyph stream: none for the first prompt (all masked), the quoted text's bytes for the second
        assert not ours["encoder_attention_mask_2"][0].any() and ours["encoder_attention_mask_2"][1].sum() > 4
        with torch.no_grad():
            want = model(**{k: call[k] for k in ours}, return_dict=False)[0]
            got = model(**ours, return_dict=False)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")


@pytest.mark.parametrize("guidance", [1.0, 6.0])
def test_hunyuanvideo15_sampler_steps_as_the_pipeline_steps(hv_folder, guidance):
    """From the pipeline's latents at each step one deterministic step of the trainer's sampler lands on its next
    latents, the last on its output. The pipeline's guider (``ClassifierFreeGuidance``: ``neg + g (pos - neg)``
    over the empty negative prompt, two forwards per step; none at g = 1) is ``flowgrpo.cfg_scale = g``; the
    sampler's two calls (``cfg_batch`` off) and its one batched call meet it to rounding (ragged text)."""
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler
    from sp_diffusers.flowgrpo.sampling.guidance import guided as guided_velocity
    from sp_diffusers.flowgrpo.sampling.sde import ode_step

    _, calls, _, final = _hv_record(hv_folder, guidance)
    _, model, adapter, schedule, encoder = _hv_parts(hv_folder, guidance)
    cond = {**_hv_text(encoder, HV_PROMPTS, "", 2), **_hv_text(encoder, [""] * 2, "negative_", 2)}
    guided = guidance > 1.0
    per_step = 2 if guided else 1
    assert len(calls) == per_step * schedule.num_steps
    sigmas = schedule.sigmas.tolist()
    for cfg_batch in (False, True) if guided else (True,):
        sampler = Sampler(OneProcessEngine(model), adapter, schedule, cfg_scale=guidance, cfg_batch=cfg_batch)
        for i in range(schedule.num_steps):
            x = calls[per_step * i]["hidden_states"][:, : adapter.channels]
            with torch.no_grad():
                v = sampler.velocity(sampler.engine_at(i), x, schedule.timesteps[i], cond)
            ours = ode_step(x, v, sigmas[i], sigmas[i + 1])
            last = i + 1 == schedule.num_steps
            want = final if last else calls[per_step * (i + 1)]["hidden_states"][:, : adapter.channels]
            # each branch's rounding (~5e-6) weighs g and g - 1 in the guided velocity
            tol = 1e-5 * (2 * guidance - 1)
            torch.testing.assert_close(ours, want, atol=tol, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")
            if guided and not cfg_batch:  # the formula itself: on the pipeline's own two calls, bit for bit
                with torch.no_grad():
                    pos, neg = (model(**{**calls[2 * i + k], "return_dict": False})[0] for k in (0, 1))
                exact = ode_step(x, guided_velocity(pos, neg, guidance).float(), sigmas[i], sigmas[i + 1])
                assert torch.equal(exact, want), f"step {i}: {(exact - want).abs().max()}"


def test_hunyuanvideo15_pixels_decode_and_encode_as_the_pipeline_does(hv_folder):
    """The decoder gives the pixels the pipeline's ``__call__`` gives (``z / scaling_factor``, then its video
    processor: ``[B, F, 3, H, W]`` in [0, 1]); the encoder inverts the scaling on the posterior's mode."""
    from diffusers import ClassifierFreeGuidance, DiffusionPipeline

    from sp_diffusers.flowgrpo.models.decode import PixelDecoder, PixelEncoder

    pipe = DiffusionPipeline.from_pretrained(hv_folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)
    _, _, adapter, _, _ = _hv_parts(hv_folder)
    kwargs = dict(prompt=HV_PROMPTS[:1], num_inference_steps=2, height=16, width=32, num_frames=5)
    latents = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(3)).frames
    pixels = pipe(**kwargs, output_type="pt", generator=torch.Generator().manual_seed(3)).frames
    ours = PixelDecoder(pipe.vae, adapter, "cpu")(latents)
    assert ours.shape == pixels.shape == (1, 5, 3, 16, 32)
    torch.testing.assert_close(ours, pixels, atol=1e-6, rtol=0)
    video = torch.rand(1, 5, 3, 16, 32, generator=torch.Generator().manual_seed(0))
    encoded = PixelEncoder(pipe.vae, adapter, "cpu")(video)
    with torch.no_grad():
        z = pipe.vae.encode(video.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode()
    assert encoded.shape == adapter.latent_shape(1)
    torch.testing.assert_close(encoded, z * pipe.vae.config.scaling_factor, atol=1e-6, rtol=0)


def test_hunyuanvideo15_guider_other_than_plain_cfg_is_refused(hv_folder, tmp_path):
    """``flowgrpo.cfg_scale`` is the folder's guider only where that guider is plain CFG at every step: a rescaled
    one is refused before anything loads (unguided rollouts still read the folder)."""
    from sp_diffusers.flowgrpo.models.pipeline_io import resolve_pipeline

    rescaled = tmp_path / "hv-rescaled"
    rescaled.mkdir()
    for entry in hv_folder.iterdir():
        if entry.name != "guider":
            (rescaled / entry.name).symlink_to(entry)
    (rescaled / "guider").mkdir()
    guider = json.loads((hv_folder / "guider" / "guider_config.json").read_text())
    (rescaled / "guider" / "guider_config.json").write_text(json.dumps({**guider, "guidance_rescale": 0.7}))
    c = TrainConfig()
    c.model.pipeline, c.flowgrpo.cfg_scale = str(hv_folder), 6.0
    assert resolve_pipeline(c) == "hunyuanvideo15"
    c = TrainConfig()
    c.model.pipeline, c.flowgrpo.cfg_scale = str(rescaled), 6.0
    with pytest.raises(ConfigError, match=r"guides with a ClassifierFreeGuidance \{'guidance_rescale': 0\.7\}.* fix: "):
        resolve_pipeline(c)
    c.flowgrpo.cfg_scale = 1.0
    assert resolve_pipeline(c) == "hunyuanvideo15"


def test_flux2_dev_folder_with_mistrals_processor_reads_its_tokenizer_without_torchvision(folders, tmp_path, monkeypatch):
    """A released FLUX.2 [dev] folder lists Mistral's ``PixtralProcessor`` as its ``tokenizer``, which transformers
    builds only with torchvision (not in this environment's lock). The trainer's text encoder then reads the folder's
    tokenizer and the processor's chat template alone: the same embeddings as the tiny folder's plain tokenizer. A
    folder whose template is nowhere is refused with one line naming torchvision."""
    import shutil

    import transformers.utils

    from sp_diffusers.families.processors import processor_tokenizer
    from sp_diffusers.flowgrpo.models.text import PipelineTextEncoder

    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    folder = tmp_path / "dev"
    shutil.copytree(folders["flux2-dev"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    template = (folder / "tokenizer" / "chat_template.jinja").read_text()
    (folder / "tokenizer" / "chat_template.jinja").unlink()  # the processor's template, in its JSON form
    (folder / "tokenizer" / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert processor_tokenizer(folders["flux2-dev"]) is None  # a plain tokenizer: nothing to replace
    assert processor_tokenizer(folder).chat_template == template
    want = PipelineTextEncoder(str(folders["flux2-dev"]), TEXT_LEN["flux2-dev"]).encode_batch(PROMPTS)
    got = PipelineTextEncoder(str(folder), TEXT_LEN["flux2-dev"]).encode_batch(PROMPTS)
    assert all(torch.equal(g, w) for g, w in zip(got["prompt_embeds"], want["prompt_embeds"], strict=True))
    # `sp-diffusers sample` reads it the same way: the same image as from the plain tokenizer's folder
    from PIL import Image

    from sp_diffusers.cli import main

    args = ["--prompt", "a red cat", "--steps", "2", "--height", "16", "--width", "16", "--max-sequence-length", "32"]
    for name, source in (("plain", folders["flux2-dev"]), ("processor", folder)):
        assert main(["sample", "--pipeline", str(source), *args, "--out", str(tmp_path / f"{name}.png")]) == 0
    plain, processor = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("plain", "processor"))
    assert plain.std() > 0 and np.array_equal(plain, processor)
    (folder / "tokenizer" / "chat_template.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer: the PixtralProcessor needs torchvision, .* fix: pip install torchvision"):
        processor_tokenizer(folder)
