"""The tiny LTX-2 pipeline folder (``save_tiny_ltx2_pipeline``) loads with ``DiffusionPipeline.from_pretrained`` and
its ``__call__`` makes a video and a stereo waveform of the sizes its components' configs imply, deterministically."""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")
if not hasattr(diffusers, "LTX2Pipeline"):
    pytest.skip(f"diffusers {diffusers.__version__} has no LTX2Pipeline", allow_module_level=True)

from sp_diffusers.tiny.pipelines import LTX2_MAX_SEQUENCE_LENGTH, PIPELINE_WRITERS, save_tiny_ltx2_pipeline  # noqa: E402

from ._engine import OneProcessEngine  # noqa: E402

HEIGHT, WIDTH, NUM_FRAMES, FRAME_RATE = 32, 64, 9, 24.0  # LTX2Pipeline wants height, width multiples of 32


def _call(pipe, seed: int):
    out = pipe(
        "a robot dancing",
        height=HEIGHT,
        width=WIDTH,
        num_frames=NUM_FRAMES,
        frame_rate=FRAME_RATE,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=LTX2_MAX_SEQUENCE_LENGTH,
        output_type="np",
        generator=torch.Generator().manual_seed(seed),
    )
    return out.frames, torch.as_tensor(out.audio)


def test_tiny_ltx2_pipeline_loads_and_generates(tmp_path):
    assert PIPELINE_WRITERS["ltx2"] is save_tiny_ltx2_pipeline
    folder = save_tiny_ltx2_pipeline(tmp_path / "ltx2")
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == "LTX2Pipeline"
    pipe.set_progress_bar_config(disable=True)

    cfg = pipe.transformer.config
    assert cfg.in_channels == cfg.audio_in_channels  # the trainer concatenates video and audio tokens
    assert pipe.vae.config.latent_channels == cfg.in_channels  # patch_size 1
    audio_cfg = pipe.audio_vae.config
    latent_mel = audio_cfg.mel_bins // pipe.audio_vae.mel_compression_ratio
    assert audio_cfg.latent_channels * latent_mel == cfg.audio_in_channels
    assert LTX2_MAX_SEQUENCE_LENGTH % pipe.connectors.config.video_connector_num_learnable_registers == 0

    video, audio = _call(pipe, seed=0)

    # video: the VAE compresses time causally, (num_frames - 1) // t + 1 latent frames decode back to (that - 1) t + 1
    t = pipe.vae.temporal_compression_ratio
    frames = ((NUM_FRAMES - 1) // t) * t + 1
    assert video.shape == (1, frames, HEIGHT, WIDTH, 3)
    assert np.isfinite(video).all()

    # audio: round(seconds x latents a second) latents, each decoded to t_a mel frames (causal: t_a L - (t_a - 1)),
    # each mel frame to prod(upsample_factors) samples, one channel per output channel
    t_a = pipe.audio_vae.temporal_compression_ratio
    latents_per_second = audio_cfg.sample_rate / audio_cfg.mel_hop_length / t_a
    audio_latents = round(NUM_FRAMES / FRAME_RATE * latents_per_second)
    mel_frames = t_a * audio_latents - (t_a - 1)
    samples = mel_frames * int(np.prod(pipe.vocoder.config.upsample_factors))
    assert audio.shape == (1, pipe.vocoder.config.out_channels, samples)
    assert torch.isfinite(audio).all() and audio.abs().max() > 0
    # the waveform is at the vocoder's rate: samples / rate = the mel frames' duration
    seconds = mel_frames * audio_cfg.mel_hop_length / audio_cfg.sample_rate
    assert samples / pipe.vocoder.config.output_sampling_rate == pytest.approx(seconds)

    video_again, audio_again = _call(pipe, seed=0)
    np.testing.assert_array_equal(video, video_again)
    torch.testing.assert_close(audio, audio_again, rtol=0, atol=0)


# --- the trainer's parts against LTX2Pipeline's own __call__ -------------------------------------------------------
# 32 x 32 pixels (the pipeline's smallest: multiples of 32) -> 16 x 16 latents; 5 frames -> 3 latent frames; at 24 fps
# the pipeline makes round(5 / 24 x 25) = 5 audio latents. Two prompts of different lengths (left-padded to 64).
IO_PROMPTS = ["a red cat", "a blue teapot on a wooden table"]
IO_SIZE, IO_FRAMES = 32, 5


@pytest.fixture(scope="module")
def ltx2_folder(tmp_path_factory):
    return save_tiny_ltx2_pipeline(tmp_path_factory.mktemp("ltx2") / "ltx2", num_layers=1)


def _plain_cfg(guidance: float) -> dict:
    """The pipeline's guidance as the trainer's sampler guides: plain CFG at ``guidance`` for video and audio."""
    return dict(
        guidance_scale=guidance, audio_guidance_scale=guidance, stg_scale=0.0, audio_stg_scale=0.0,
        modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
    )


def _io_call(folder, guidance: float, output_type: str, steps: int = 3):
    """The pipeline's every transformer call (kwargs), its timesteps and its output."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
    out = pipe(
        IO_PROMPTS, height=IO_SIZE, width=IO_SIZE, num_frames=IO_FRAMES, frame_rate=24.0,
        num_inference_steps=steps, max_sequence_length=LTX2_MAX_SEQUENCE_LENGTH, output_type=output_type,
        generator=torch.Generator().manual_seed(0), **_plain_cfg(guidance),
    )
    hook.remove()
    return pipe, calls, pipe.scheduler.timesteps.tolist(), out


def _io_parts(folder, cfg_scale: float = 1.0):
    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.frames = str(folder), IO_SIZE // 2, (IO_FRAMES - 1) // 2 + 1
    c.text.max_sequence_length = LTX2_MAX_SEQUENCE_LENGTH
    c.flowgrpo.num_steps, c.flowgrpo.cfg_scale = 3, cfg_scale
    assert resolve_pipeline(c) == "ltx2" and c.model.kind == "ltx2"
    model = load_transformers(c)["transformer"]
    adapter = build_adapter(
        model, c.model.image_size, True, c.model.frames, frame_rate=c.model.frame_rate, pipeline=c.model.pipeline
    )
    return c, model, adapter, run_schedule(c, adapter), build_text_encoder(c, torch.device("cpu"))


def _io_text(encoder, prompts, prefix: str) -> dict:
    from sp_diffusers.parallel.padding import pad_text_batch

    text = encoder.encode_batch(prompts, prefix=prefix)
    out = {}
    for suffix in ("", "_2"):
        key, mask = f"{prefix}prompt_embeds{suffix}", f"{prefix}prompt_embeds_mask{suffix}"
        out[key], out[mask] = pad_text_batch(text[key], text[mask], 1, key)
    return out


def test_ltx2_inputs_as_the_pipeline(ltx2_folder):
    """The trainer's parts give LTX-2's transformer what ``LTX2Pipeline`` gives it: the same timesteps (its shift over
    the video tokens), both latent streams and the timestep (and ``sigma``) bit for bit, the connectors' video and
    audio text streams and their mask bit for bit (every one of the 64 rows: the registers fill the padding), and the
    audio length the pipeline derives from the frame count; the pipeline's precomputed RoPE coordinates are what the
    forward builds from the sizes and frame rate we pass, so the outputs (video and audio) are equal."""
    _, calls, timesteps, _ = _io_call(ltx2_folder, 1.0, "latent")
    _, model, adapter, schedule, encoder = _io_parts(ltx2_folder)
    assert schedule.timesteps.tolist() == pytest.approx(timesteps, abs=1e-4) and len(calls) == 3
    assert encoder.hidden_size == model.config.caption_channels
    assert adapter.audio_frames == calls[0]["audio_num_frames"] == 5
    assert adapter.tokens == calls[0]["hidden_states"].shape[1] == 3 * 16 * 16
    text = _io_text(encoder, IO_PROMPTS, "")
    for i, call in enumerate(calls):
        latents = torch.cat([call["hidden_states"], call["audio_hidden_states"]], dim=1)
        assert latents.shape == adapter.latent_shape(2)
        ours = adapter.inputs(
            latents, schedule.timesteps[i], text["prompt_embeds"], text["prompt_embeds_mask"],
            text_2=(text["prompt_embeds_2"], text["prompt_embeds_mask_2"]),
        )
        for key in ("hidden_states", "audio_hidden_states", "timestep", "sigma", "encoder_hidden_states",
                    "audio_encoder_hidden_states", "encoder_attention_mask", "audio_encoder_attention_mask",
                    "num_frames", "height", "width", "fps", "audio_num_frames", "use_cross_timestep"):
            got, want = ours[key], call[key]
            if isinstance(want, torch.Tensor):
                assert torch.equal(got.to(want.dtype), want), f"step {i}: {key}"
            else:
                assert got == want, f"step {i}: {key}"
        with torch.no_grad():
            want = model(**call)
            got = model(**ours, return_dict=False)
        for name, g, w in zip(("video", "audio"), got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0, msg=lambda m, i=i, n=name: f"step {i} {n}: {m}")


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ltx2_sampler_steps_and_decodes_as_the_pipeline(ltx2_folder, guidance):
    """From the pipeline's latents at each step one deterministic step of the trainer's sampler lands on its next
    latents (both streams); the last lands on its output. The pipeline's guidance at ``stg_scale=0,
    modality_scale=1, guidance_rescale=0`` with one scale for both streams (in x0 space: ``x0 + (g - 1)(x0 -
    x0_neg)``) is ``flowgrpo.cfg_scale = g`` (velocity space, the same to rounding: each branch's rounding weighs
    g and g - 1). The decoders then give the pipeline's frames and soundtrack from those final latents."""
    from sp_diffusers.flowgrpo.models.decode import PixelDecoder
    from sp_diffusers.flowgrpo.models.ltx2 import AudioDecoder
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler
    from sp_diffusers.flowgrpo.sampling.sde import ode_step

    pipe, calls, _, out = _io_call(ltx2_folder, guidance, "latent")
    _, model, adapter, schedule, encoder = _io_parts(ltx2_folder, guidance)
    cond = {**_io_text(encoder, IO_PROMPTS, ""), **_io_text(encoder, [""] * 2, "negative_")}
    sigmas = schedule.sigmas.tolist()
    tol = 2e-5 * (2 * guidance - 1)
    batch = 2 if guidance > 1 else 1  # the pipeline's CFG stacks [negative, positive]
    final = None
    for cfg_batch in (False, True) if guidance > 1 else (True,):
        sampler = Sampler(OneProcessEngine(model), adapter, schedule, cfg_scale=guidance, cfg_batch=cfg_batch)
        for i in range(schedule.num_steps):
            call = calls[i]
            x = torch.cat([call["hidden_states"], call["audio_hidden_states"]], dim=1)[-2:]  # the positive half
            assert x.shape[0] * batch == call["hidden_states"].shape[0]
            with torch.no_grad():
                v = sampler.velocity(sampler.engine_at(i), x, schedule.timesteps[i], cond)
            nxt = ode_step(x, v, sigmas[i], sigmas[i + 1])
            if i + 1 < schedule.num_steps:
                want = torch.cat([calls[i + 1]["hidden_states"], calls[i + 1]["audio_hidden_states"]], dim=1)[-2:]
                torch.testing.assert_close(nxt, want, atol=tol, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")
            else:
                final = nxt
    # output_type="latent": the video de-normalised and unpacked, the audio de-normalised and unpacked
    video, audio = out.frames, out.audio
    torch.testing.assert_close(adapter.to_vae(pipe.vae, final), video, atol=tol, rtol=0)
    torch.testing.assert_close(adapter.audio_vae_latents(pipe.audio_vae, final), audio, atol=tol, rtol=0)
    # decoded from the pipeline's own last step (its final latents, normalised and packed back)
    _, _, _, decoded = _io_call(ltx2_folder, guidance, "pt")
    latents = _pipeline_final(pipe, adapter, video, audio)
    # the latents came back through de-normalise / normalise (a few ulps each) before the decoders, which carry that
    # into their outputs (4e-7 on pixels in [0, 1], 2e-8 on the waveform measured here): 5e-6 leaves room for another
    # CPU's rounding
    pixels = PixelDecoder(pipe.vae, adapter, "cpu")(latents)
    assert pixels.shape == decoded.frames.shape == (2, IO_FRAMES, 3, IO_SIZE, IO_SIZE)
    torch.testing.assert_close(pixels, decoded.frames.float(), atol=5e-6, rtol=0)
    decoder = AudioDecoder(pipe.audio_vae, pipe.vocoder, adapter, "cpu")
    assert decoder.sample_rate == pipe.vocoder.config.output_sampling_rate
    torch.testing.assert_close(decoder(latents), decoded.audio.float(), atol=5e-6, rtol=0)


def _pipeline_final(pipe, adapter, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """The pipeline's ``output_type="latent"`` outputs back in the trainer's layout (normalised, packed)."""
    vae, avae = pipe.vae, pipe.audio_vae
    z = (video - vae.latents_mean.view(1, -1, 1, 1, 1)) * vae.config.scaling_factor / vae.latents_std.view(1, -1, 1, 1, 1)
    packed_video = z.permute(0, 2, 3, 4, 1).flatten(1, 3)
    packed_audio = (audio.transpose(1, 2).flatten(2, 3) - avae.latents_mean) / avae.latents_std
    latents = torch.cat([packed_video, packed_audio], dim=1)
    assert latents.shape == adapter.latent_shape(video.shape[0])
    return latents


def test_sample_writes_the_soundtrack_beside_and_into_the_video(ltx2_folder, tmp_path):
    """``sp-diffusers sample`` of one prompt on an LTX-2 folder: the trainer's sampler (plain CFG at ``--guidance``
    for both streams), the frames as an MP4 with the soundtrack muxed in as AAC, and the same waveform as a 16-bit WAV
    beside it: the pipeline's own soundtrack at those settings, to the WAV's quantisation (1 / 32767)."""
    import subprocess

    import imageio_ffmpeg

    from sp_diffusers.flowgrpo.io import sample
    from sp_diffusers.flowgrpo.io.media import read_video, read_wav

    out = sample.render(
        ltx2_folder, ["a red cat"], tmp_path / "cat.mp4", steps=2, height=IO_SIZE, width=IO_SIZE, frames=IO_FRAMES,
        guidance=3.0, max_sequence_length=LTX2_MAX_SEQUENCE_LENGTH,
    )
    assert out == tmp_path / "cat.mp4" and read_video(out).shape == (IO_FRAMES, 3, IO_SIZE, IO_SIZE)
    probe = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-i", str(out)], capture_output=True, text=True).stderr
    assert "Video: h264" in probe and "Audio: aac" in probe, probe
    wave, rate = read_wav(out.with_suffix(".wav"))
    pipe = diffusers.DiffusionPipeline.from_pretrained(ltx2_folder)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        ["a red cat"], height=IO_SIZE, width=IO_SIZE, num_frames=IO_FRAMES, num_inference_steps=2,
        max_sequence_length=LTX2_MAX_SEQUENCE_LENGTH, output_type="pt", generator=torch.Generator("cpu").manual_seed(0),
        **_plain_cfg(3.0),
    ).audio[0]
    assert rate == pipe.vocoder.config.output_sampling_rate and wave.shape == want.shape
    torch.testing.assert_close(wave, want.float().clamp(-1, 1), atol=1.0 / 32767, rtol=0)


def test_an_audio_stream_shorter_than_the_sp_degree_is_refused_by_name():
    """The two-stream plan splits the audio tokens over the SP ranks too: fewer of them than ranks is refused before
    the run starts, naming the keys that set the audio length."""
    from sp_diffusers.flowgrpo.build import check_run
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.models.ltx2 import ltx2_adapter
    from sp_diffusers.tiny import tiny_model

    model = tiny_model("ltx2", num_layers=1)
    c = TrainConfig()
    c.model.kind, c.model.frames, c.model.image_size = "ltx2", 2, 8

    class Text:  # the connectors' width, as the model takes it
        hidden_size = model.config.caption_channels

    adapter = ltx2_adapter(model, 2, 8, 8, audio_frames=3)
    assert adapter.audio_tokens == 3 and adapter.tokens == 128
    check_run(c, model, Text(), adapter, 3)  # 3 audio tokens over 3 ranks: one each
    with pytest.raises(ValueError, match=r"gives 3 audio tokens \(model\.audio_frames=0\), fewer than the SP degree 4; "
                       r"fix: a longer video \(more model\.frames\) or a larger model\.audio_frames"):
        check_run(c, model, Text(), adapter, 4)
