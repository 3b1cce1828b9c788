"""How FlowGRPO calls LTX-2 (``LTX2VideoTransformer3DModel``: video and audio together), as ``LTX2Pipeline`` (text to
video with audio) calls it.

- Latents: one tensor per sample, the video tokens then the audio tokens, ``[B, F*H*W + L, C]``. The pipeline keeps
  two: packed video latents ``[B, F*H*W, C]`` (patch 1: one token per latent voxel, ``AutoencoderKLLTX2Video``) and
  packed audio latents ``[B, L, C_a * M]`` (``AutoencoderKLLTX2Audio``'s ``[B, C_a, L, M]`` with its ``M`` latent
  mel bins folded into the channels). Both widths are the model's ``in_channels`` / ``audio_in_channels``, equal in
  the released model (128), so the two streams share one tensor and one SDE: each stream's step is the pipeline's
  (both schedulers are the same copy), and the policy's log-prob is the joint Gaussian's over both.
- Time: the schedule's timestep (0..1000) as ``timestep`` and ``sigma`` (LTX-2.3 reads it), ``[B]``, for both
  streams; ``use_cross_timestep`` as ``__call__``'s default (True).
- Text: the Gemma states through the pipeline's ``connectors`` (``LTX2TextConnectors``): one video stream
  (``encoder_hidden_states``, the trainer's ``prompt_embeds``) and one audio stream (``audio_encoder_hidden_states``,
  the trainer's ``prompt_embeds_2``) over one mask. With learnable registers the connectors fill the padding and the
  mask is all ones: every prompt is ``max_sequence_length`` rows, as the pipeline hands them.
- Positions: ``num_frames`` / ``height`` / ``width`` / ``fps`` and ``audio_num_frames``: the forward builds the RoPE
  coordinates the pipeline builds (``prepare_video_coords`` / ``prepare_audio_coords``) from them.
- Guidance: ``flowgrpo.cfg_scale`` s is both ``guidance_scale`` and ``audio_guidance_scale``, the pipeline's
  ``x0 + (s - 1)(x0 - x0_neg)``, which is ``v_neg + s (v - v_neg)`` in velocity. The pipeline's other guidance terms
  (``stg_scale``, ``modality_scale``, ``guidance_rescale``) are not part of the trainer's sampler: a rollout is the
  pipeline's sample at ``stg_scale=0, modality_scale=1, guidance_rescale=0`` (each ``audio_*`` the same).
- Output: the two velocities, joined back into the trainer's layout (:meth:`LTX2Adapter.noisy_output`).
- Decoding: the video part unpacked to ``[B, C, F, H, W]`` and de-normalised with the VAE's own ``latents_mean`` /
  ``latents_std`` buffers and ``scaling_factor``; the audio part de-normalised with the audio VAE's buffers, unfolded
  to ``[B, C_a, L, M]``, decoded to a mel spectrogram and turned into a waveform by the vocoder
  (:class:`AudioDecoder`).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import FamilyAdapter

__all__ = ["FRAME_RATE", "AudioDecoder", "LTX2Adapter", "audio_latents", "ltx2_adapter", "ltx2_audio_frames"]

FRAME_RATE = 24.0  # LTX2Pipeline.__call__'s frame_rate default (model.frame_rate's too)


def audio_latents(latent_frames: int, temporal: int, per_second: float, frame_rate: float = FRAME_RATE) -> int:
    """The latent audio length ``LTX2Pipeline.__call__`` makes for ``latent_frames`` latent video frames: they decode
    to ``(latent_frames - 1) x temporal + 1`` frames, which last ``frames / frame_rate`` seconds, at ``per_second``
    audio latents a second (``sample_rate / mel_hop_length / 4``: 25 as released), ``round(seconds x rate)``."""
    return round(((latent_frames - 1) * temporal + 1) / frame_rate * per_second)


@dataclass(frozen=True)
class LTX2Adapter(FamilyAdapter):
    """``LTX2VideoTransformer3DModel`` on ``[B, frames*height*width + audio_frames, channels]`` latents."""

    frames: int  # latent video frames, height, width (patch 1: one token each)
    height: int
    width: int
    channels: int  # the packed width of both streams (in_channels == audio_in_channels)
    audio_frames: int  # latent audio length L (one token each)
    fps: float  # the frame rate the video RoPE is conditioned on (__call__'s frame_rate / motion_speed)
    takes_sigma: bool = True  # the forward takes sigma / use_cross_timestep (diffusers >= 0.40)

    @property
    def tokens(self) -> int:
        """The video tokens: what the pipeline's schedule shift (``mu``) reads."""
        return self.frames * self.height * self.width

    @property
    def audio_tokens(self) -> int:
        return self.audio_frames  # one token per latent audio frame

    def latent_shape(self, batch: int) -> tuple[int, int, int]:
        return (batch, self.tokens + self.audio_frames, self.channels)

    def split(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """The trainer's latents -> (packed video ``[B, F*H*W, C]``, packed audio ``[B, L, C]``)."""
        if latents.ndim != 3 or latents.shape[1] != self.tokens + self.audio_frames:
            raise ValueError(
                f"LTX2Adapter: latents {tuple(latents.shape)} are not [B, {self.tokens} video + {self.audio_frames} "
                f"audio tokens, {self.channels}]"
            )
        return latents[:, : self.tokens], latents[:, self.tokens :]

    def inputs(
        self,
        latents: Tensor,
        timestep: Tensor,
        embeds: Tensor,
        mask: Tensor,
        pooled: Tensor | None = None,
        text_2: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Any]:
        """The forward's kwargs; ``embeds`` / ``mask``: the connectors' video stream, ``text_2``: their audio stream
        ``([B, T, D_a], [B, T] mask)``."""
        if text_2 is None:
            raise ValueError(
                "LTX2Adapter: no audio text stream (prompt_embeds_2); fix: encode prompts with the LTX2Pipeline "
                "folder's own text encoder and connectors (text.pipeline / model.pipeline)"
            )
        video, audio = self.split(latents)
        batch, dtype = latents.shape[0], latents.dtype
        t = timestep.to(dtype).expand(batch)
        kwargs: dict[str, Any] = dict(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=embeds.to(dtype),
            audio_encoder_hidden_states=text_2[0].to(dtype),
            timestep=t,
            encoder_attention_mask=mask.to(dtype),
            audio_encoder_attention_mask=text_2[1].to(dtype),
            num_frames=self.frames,
            height=self.height,
            width=self.width,
            fps=self.fps,
            audio_num_frames=self.audio_frames,
        )
        if self.takes_sigma:
            kwargs.update(sigma=t, use_cross_timestep=True)
        return kwargs

    def noisy_output(self, out: tuple[Tensor, Tensor] | Tensor) -> Tensor:
        """The forward's ``(video, audio)`` velocities as one tensor in the trainer's layout."""
        if isinstance(out, Tensor):
            raise ValueError(
                "LTX2Adapter: the transformer returned one tensor, not (video, audio); fix: an engine whose forward "
                "returns every output of a multi-output model (FSDPEngine.forward)"
            )
        video, audio = out
        return torch.cat([video, audio.to(video.dtype)], dim=1)

    def reward_view(self, latents: Tensor) -> Tensor:
        """The video part channels-last ``[B, F, H, W, C]`` (the latent rewards read the video)."""
        video, _ = self.split(latents)
        return video.reshape(video.shape[0], self.frames, self.height, self.width, self.channels)

    def vae_latents(self, latents: Tensor) -> Tensor:
        """The video part as ``AutoencoderKLLTX2Video`` takes it: ``[B, C, F, H, W]`` (``_unpack_latents``)."""
        return self.reward_view(latents).permute(0, 4, 1, 2, 3)

    def to_vae(self, vae: Any, latents: Tensor) -> Tensor:
        """``_denormalize_latents``: ``z * std / scaling_factor + mean`` over the channels (the VAE's buffers)."""
        z = self.vae_latents(latents)
        mean, std = (b.view(1, -1, 1, 1, 1).to(z.device, z.dtype) for b in (vae.latents_mean, vae.latents_std))
        return z * std / vae.config.scaling_factor + mean

    def from_vae(self, vae: Any, z: Tensor) -> Tensor:
        """A posterior's ``[B, C, F, H, W]`` -> the trainer's layout (the video normalised; the audio part zeros)."""
        mean, std = (b.view(1, -1, 1, 1, 1).to(z.device, z.dtype) for b in (vae.latents_mean, vae.latents_std))
        video = ((z - mean) * vae.config.scaling_factor / std).permute(0, 2, 3, 4, 1).flatten(1, 3)
        return torch.cat([video, video.new_zeros(video.shape[0], self.audio_frames, self.channels)], dim=1)

    def decode_kwargs(self, vae: Any, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """A timestep-conditioned VAE decodes at the pipeline's ``decode_timestep`` (0) and ``decode_noise_scale`` (0:
        the latents unchanged)."""
        if not vae.config.timestep_conditioning:
            return {}
        return {"temb": torch.zeros(batch, device=device, dtype=dtype)}

    def pixel_layout(self, decoded: Tensor) -> Tensor:
        return decoded.permute(0, 2, 1, 3, 4)  # [B, 3, F, H, W] -> [B, F, 3, H, W]

    def vae_pixels(self, pixels: Tensor) -> Tensor:
        return pixels.permute(0, 2, 1, 3, 4)  # [B, F, 3, H, W] -> [B, 3, F, H, W]

    def audio_vae_latents(self, audio_vae: Any, latents: Tensor) -> Tensor:
        """The audio part as ``AutoencoderKLLTX2Audio.decode`` takes it: de-normalised over the packed width
        (``_denormalize_audio_latents``), then ``[B, L, C_a * M]`` -> ``[B, C_a, L, M]`` (``_unpack_audio_latents``)."""
        _, audio = self.split(latents)
        mean = audio_vae.latents_mean.to(audio.device, audio.dtype)
        std = audio_vae.latents_std.to(audio.device, audio.dtype)
        audio = audio * std + mean
        mel_bins = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
        return audio.unflatten(2, (-1, mel_bins)).transpose(1, 2)


class AudioDecoder:
    """``decoder(latents [b, ...]) -> waveforms [b, channels, samples]`` float32: the audio VAE's mel spectrogram
    through the vocoder, as ``LTX2Pipeline`` decodes its audio; ``sample_rate`` is the vocoder's output rate."""

    def __init__(self, audio_vae: torch.nn.Module, vocoder: torch.nn.Module, adapter: LTX2Adapter, device: Any) -> None:
        self.audio_vae = audio_vae.to(device).eval().requires_grad_(False)
        self.vocoder = vocoder.to(device).eval().requires_grad_(False)
        self.adapter, self.device = adapter, torch.device(device)
        self.dtype = next(self.audio_vae.parameters()).dtype
        self.sample_rate = int(self.vocoder.config.output_sampling_rate)

    @torch.no_grad()
    def __call__(self, latents: Tensor) -> Tensor:
        z = self.adapter.audio_vae_latents(self.audio_vae, latents.to(self.device, self.dtype))
        mel = self.audio_vae.decode(z, return_dict=False)[0]
        return self.vocoder(mel.to(next(self.vocoder.parameters()).dtype)).float()


def ltx2_audio_frames(pipeline: str | Path, latent_frames: int, frame_rate: float) -> int:
    """The latent audio length ``LTX2Pipeline.__call__`` gives a video of ``latent_frames`` latent frames at
    ``frame_rate``: its ``(latent_frames - 1) * temporal compression + 1`` frames last ``duration`` seconds, and the audio
    VAE has ``sample_rate / mel_hop_length / 4`` latents a second (``round(duration * rate)``). Read from the folder's
    ``vae`` and ``audio_vae`` configs (a key a config leaves out: the class's default)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

    def read(component: str, cls: type) -> Any:
        config = json.loads((Path(pipeline) / component / "config.json").read_text())
        defaults = inspect.signature(cls.__init__).parameters
        return lambda key: config[key] if config.get(key) is not None else defaults[key].default

    vae, audio = read("vae", AutoencoderKLLTX2Video), read("audio_vae", AutoencoderKLLTX2Audio)
    # AutoencoderKLLTX2Video.temporal_compression_ratio when its config leaves it out
    temporal = vae("temporal_compression_ratio") or vae("patch_size_t") * 2 ** sum(vae("spatio_temporal_scaling"))
    per_second = audio("sample_rate") / audio("mel_hop_length") / 4.0  # the audio VAE's fixed 4x in time
    return audio_latents(latent_frames, temporal, per_second, frame_rate)


def ltx2_adapter(
    model: torch.nn.Module, frames: int, height: int, width: int, audio_frames: int, fps: float = FRAME_RATE
) -> LTX2Adapter:
    """The adapter for an LTX-2 transformer at ``frames`` x ``height`` x ``width`` latent video and ``audio_frames``
    latent audio; ``fps``: the frame rate the video positions are conditioned on."""
    config = model.config
    if config.patch_size != 1 or config.patch_size_t != 1:
        raise ValueError(
            f"the FlowGRPO LTX-2 adapter packs one token per latent voxel; the model has patch_size={config.patch_size}, "
            f"patch_size_t={config.patch_size_t}; fix: an LTX2VideoTransformer3DModel with patch sizes 1 (as released)"
        )
    if config.in_channels != config.audio_in_channels:
        raise ValueError(
            f"the FlowGRPO LTX-2 adapter keeps the video and audio tokens in one latent tensor, so in_channels="
            f"{config.in_channels} must equal audio_in_channels={config.audio_in_channels} (128 both, as released)"
        )
    if min(frames, height, width) < 1 or audio_frames < 1:
        raise ValueError(
            f"model.frames={frames}, model.image_size x image_width={height} x {width}, model.audio_frames="
            f"{audio_frames}: each must be >= 1 (latent sizes)"
        )
    takes = inspect.signature(model.forward).parameters
    return LTX2Adapter(
        frames, height, width, config.in_channels, audio_frames, float(fps), "sigma" in takes and "use_cross_timestep" in takes
    )
