"""The micro-batch of a plan: pixels (or a token count) -> latent grid -> transformer tokens, and the forward
inputs of that size for a model (built by ``sp_diffusers.tiny.tiny_inputs``, the one source of each family's
input layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .models import ModelSpec, PlanError

__all__ = ["Workload", "audio_tokens", "build_inputs", "workload_from_pixels", "workload_from_tokens"]

CLIP_IMAGE_TOKENS = 257  # Wan2.1 I2V's image tokens: CLIP ViT-H/14 at 224 px, 256 patches + the class token


@dataclass(frozen=True)
class Workload:
    """One micro-batch: ``batch`` samples of a latent grid of ``grid`` tokens (frames, height, width) and text."""

    batch: int
    grid: tuple[int, int, int]  # tokens along (time, height, width)
    text_len: int
    pixels: tuple[int, int, int] | None = None  # (height, width, frames) asked for; None with --tokens
    condition_tokens: int = 0  # an edit's condition image tokens, in the same sequence (ModelSpec.condition)
    audio_tokens: int = 0  # LTX-2: the audio stream's tokens (its own sequence, beside the video's)

    @property
    def tokens(self) -> int:
        """The transformer's image / video tokens, an edit's condition tokens included."""
        t, h, w = self.grid
        return t * h * w + self.condition_tokens

    def describe(self, spec: ModelSpec) -> str:
        f = spec.family
        t, h, w = self.grid
        how = (
            f"VAE {f.vae_spatial}x spatial"
            + (f", {f.vae_temporal}x temporal" if f.video else "")
            + ", patch "
            + (f"{f.patch_t}x" if f.video else "")
            + f"{f.patch}x{f.patch}"
        )
        source = ""
        if self.pixels is not None:
            ph, pw, frames = self.pixels
            source = f"{ph}x{pw}" + (f" x {frames} frames" if f.video else "") + " -> "
        grid = f"{t} x {h} x {w}" if f.video else f"{h} x {w}"
        if self.condition_tokens:
            grid += f" + {self.condition_tokens:,} condition tokens"
        if self.audio_tokens:
            grid += f" + {self.audio_tokens:,} audio tokens"
        return f"{source}{self.tokens:,} tokens ({grid}; {how}) + {self.text_len} text tokens, batch {self.batch}"


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name}={value!r} is invalid: it must be a positive integer")
    return value


def workload_from_pixels(
    spec: ModelSpec, height: int, width: int, frames: int = 1, batch: int = 1, text_len: int | None = None
) -> Workload:
    """The tokens of ``height x width`` pixels (and ``frames`` for video) after the family's VAE and patching."""
    f = spec.family
    m = f.pixel_multiple
    for name, value in (("--height", height), ("--width", width)):
        _positive(name, value)
        if value % m:
            lower, upper = value // m * m, -(-value // m) * m
            raise PlanError(
                f"{name} {value} is not a multiple of {m} ({spec.name}: VAE {f.vae_spatial}x times patch "
                f"{f.patch}); fix: use {lower or upper} or {upper}"
            )
    _positive("--frames", frames)
    _positive("--batch", batch)
    if not f.video and frames != 1:
        raise PlanError(f"--frames {frames}: {spec.name} makes images; fix: leave --frames out (or 1)")
    if f.video and (frames - 1) % f.vae_temporal:
        k = (frames - 1) // f.vae_temporal
        raise PlanError(
            f"--frames {frames}: {spec.name}'s VAE takes {f.vae_temporal}k + 1 frames; fix: use "
            f"{k * f.vae_temporal + 1} or {(k + 1) * f.vae_temporal + 1}"
        )
    latent_t = (frames - 1) // f.vae_temporal + 1 if f.video else 1
    if latent_t % f.patch_t:
        raise PlanError(
            f"--frames {frames}: {latent_t} latent frames do not divide the temporal patch {f.patch_t}"
        )
    grid = (latent_t // f.patch_t, height // m, width // m)
    return Workload(
        batch, grid, _text_len(spec, text_len), (height, width, frames), _condition(spec, grid), audio_tokens(spec, latent_t)
    )


def _condition(spec: ModelSpec, grid: tuple[int, int, int]) -> int:
    """An edit's condition tokens: each of its ``condition_images`` at the output's size (the pipelines' ~1 MP at a
    ~1 MP output)."""
    return grid[0] * grid[1] * grid[2] * spec.condition_images if spec.condition == "edit" else 0


def workload_from_tokens(
    spec: ModelSpec, tokens: int, batch: int = 1, text_len: int | None = None
) -> Workload:
    """About ``tokens`` tokens as a near-16:9 grid (video: frames of at most 720p, 45 x 80 tokens each)."""
    _positive("--tokens", tokens)
    _positive("--batch", batch)
    frames = max(1, math.ceil(tokens / 3600)) if spec.family.video else 1
    per_frame = max(1, round(tokens / frames))
    h = max(1, math.isqrt(per_frame * 9 // 16) if spec.family.video else math.isqrt(per_frame))
    w = max(1, round(per_frame / h))
    return Workload(
        batch,
        (frames, h, w),
        _text_len(spec, text_len),
        condition_tokens=_condition(spec, (frames, h, w)),
        audio_tokens=audio_tokens(spec, frames * spec.family.patch_t),
    )


def audio_tokens(spec: ModelSpec, latent_frames: int) -> int:
    """LTX-2's audio tokens for ``latent_frames`` latent video frames, as ``LTX2Pipeline.__call__`` makes them: its
    ``(latent_frames - 1) x temporal compression + 1`` frames last ``frames / 24`` s (``frame_rate`` 24), and the
    audio VAE has ``audio_sampling_rate / audio_hop_length / audio_scale_factor`` latents a second (the transformer
    config's copy of them: 16000 / 160 / 4 = 25 released), ``round(seconds x rate)`` of them, one token each (audio
    patch 1). 0 for a family without audio."""
    from ..flowgrpo.models.ltx2 import audio_latents

    if spec.kind != "ltx2":
        return 0
    c = spec.config
    per_second = c.get("audio_sampling_rate", 16000) / c.get("audio_hop_length", 160) / c.get("audio_scale_factor", 4)
    return max(1, audio_latents(latent_frames, spec.family.vae_temporal, per_second))


def _text_len(spec: ModelSpec, text_len: int | None) -> int:
    return spec.family.text_len if text_len is None else _positive("--text-len", text_len)


def build_inputs(spec: ModelSpec, model: torch.nn.Module, work: Workload) -> dict[str, Any]:
    """The forward kwargs of ``work`` for ``model`` (full-length text, no padding mask)."""
    from ..tiny import tiny_inputs

    f = spec.family
    t, h, w = work.grid
    latent = (t * f.patch_t, h * f.patch, w * f.patch)
    # flux's builder takes the packed token grid, the others the latent grid they patchify themselves
    image_hw = (h, w) if f.kind == "flux" else latent[1:]
    options: dict[str, Any] = {}
    if spec.condition == "edit":  # each condition image's tokens after the noisy ones
        options["condition_hw"] = (image_hw,) * spec.condition_images
    elif spec.condition == "ti2v":
        options["first_frame_timestep"] = True
    elif spec.condition == "i2v" and model.config.get("image_dim"):
        options["clip_tokens"] = CLIP_IMAGE_TOKENS
    if work.audio_tokens:
        options["audio_len"] = work.audio_tokens
    inputs = tiny_inputs(
        f.kind,
        model,
        batch=work.batch,
        text_len=work.text_len,
        image_hw=image_hw,
        frames=latent[0],
        ragged_text=False,
        **options,
    )
    if f.kind == "flux" and model.config.get("guidance_embeds"):
        inputs["guidance"] = torch.full((work.batch,), 3.5)
    return inputs
