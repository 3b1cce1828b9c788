"""Image-to-video: Wan2.1 I2V, Wan2.2 I2V-A14B (two experts) and Wan2.2 TI2V-5B, called as ``WanImageToVideoPipeline``
calls them.

- **I2V (Wan2.1, Wan2.2-A14B)**: the pipeline VAE-encodes the first frame followed by zero frames and concatenates, as
  channels, a first-frame mask (the VAE's temporal factor in channels) and those latents to the noisy ones:
  ``hidden_states = [noisy | mask | condition]`` along C. The condition is per video token, so SP shards it with
  the video (Wan's plan splits the patch-embedded sequence). Wan2.1 also passes CLIP image tokens
  (``encoder_hidden_states_image``, the penultimate hidden states of the pipeline's ``image_encoder``), which the
  transformer puts before the text and its attention tells apart by position: the text must be exactly 512 rows.
- **TI2V (Wan2.2-5B, ``expand_timesteps``)**: the first latent frame *is* the image's latents (``(1 - m) c + m x``,
  ``m`` 0 on the first frame) and each video token gets its own timestep, 0 on the first frame: ``timestep [B, N]``,
  which Wan's plan splits with the tokens. The pipeline discards the model's output there and replaces the first
  frame after its loop; here the velocity of the first frame is 0 (the policy's log-probs do not depend on tokens
  the pipeline throws away) and the final latents get the image's first frame (``final_latents``).

The condition is the first frame resized to the output size (the pipeline's own ``video_processor.preprocess``),
prepared by the pipeline's own ``prepare_latents`` / ``encode_image``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .adapters import WanAdapter

__all__ = ["WanI2VAdapter", "wan_i2v_adapter"]

WAN_I2V_TEXT_LEN = 512  # WanAttnProcessor: image tokens = encoder_hidden_states.shape[1] - 512


@dataclass(frozen=True)
class WanI2VAdapter(WanAdapter):
    """``expand_timesteps``: TI2V (first frame replaced, per-token timesteps); ``image_embeds``: the transformer reads
    CLIP image tokens (Wan2.1 I2V); ``vae_scale``: (temporal, spatial) compression of the pipeline's VAE."""

    expand_timesteps: bool = False
    image_embeds: bool = False
    vae_scale: tuple[int, int] = (4, 8)
    conditioned = True
    images_per_row = 1

    @property
    def output_pixels(self) -> tuple[int, int]:
        return self.height * self.vae_scale[1], self.width * self.vae_scale[1]

    @property
    def pixel_frames(self) -> int:
        return (self.frames - 1) * self.vae_scale[0] + 1

    def frame_mask(self, like: torch.Tensor) -> torch.Tensor:
        """``[1, 1, F, H, W]``: 0 on the first latent frame, 1 elsewhere (the pipeline's ``first_frame_mask``)."""
        m = like.new_ones((1, 1, self.frames, self.height, self.width))
        m[:, :, 0] = 0
        return m

    def inputs(self, latents, timestep, embeds, mask, pooled=None, condition=None) -> dict[str, Any]:
        kwargs = super().inputs(latents, timestep, embeds, mask, pooled)
        c = condition["condition_latents"].to(latents.dtype)
        if self.expand_timesteps:
            m = self.frame_mask(latents)
            kwargs["hidden_states"] = (1 - m) * c + m * latents
            pt, ph, pw = self.patch
            tokens = m[0, 0, ::pt, ::ph, ::pw].flatten()  # one per video token, as the pipeline takes it
            t = kwargs["timestep"]
            kwargs["timestep"] = t[:, None] * tokens[None, :]
        else:
            kwargs["hidden_states"] = torch.cat([latents, c], dim=1)
        if self.image_embeds:
            kwargs["encoder_hidden_states_image"] = condition["condition_image_embeds"].to(latents.dtype)
        return kwargs

    def noisy_output(self, out: torch.Tensor) -> torch.Tensor:
        return out * self.frame_mask(out) if self.expand_timesteps else out

    def final_latents(self, latents: torch.Tensor, condition: dict[str, torch.Tensor]) -> torch.Tensor:
        """TI2V: the first latent frame replaced by the image's, as the pipeline does after its loop."""
        if not self.expand_timesteps:
            return latents
        m = self.frame_mask(latents)
        return (1 - m) * condition["condition_latents"].to(latents) + m * latents

    @torch.no_grad()
    def prepare_condition(
        self, pipe: Any, images: list[list[Any]]
    ) -> tuple[dict[str, torch.Tensor], list[Any]]:
        """Each row's first frame -> ``condition_latents`` (``[R, mask + z, F, H, W]``; TI2V ``[R, z, 1, H, W]``) and
        ``condition_image_embeds`` (``[R, T, D]``, Wan2.1), by the pipeline's own ``prepare_latents`` /
        ``encode_image``; the text does not read the image."""
        height, width = self.output_pixels
        device = pipe.vae.device
        conds, embeds = [], []
        for row in images:
            pixels = pipe.video_processor.preprocess(row[0], height=height, width=width).to(
                device, torch.float32
            )
            zeros = torch.zeros(1, self.channels, self.frames, self.height, self.width, device=device)
            out = pipe.prepare_latents(
                pixels, 1, self.channels, height, width, self.pixel_frames, torch.float32, device, None, zeros
            )
            conds.append(out[1].float().cpu())
            if self.image_embeds:
                embeds.append(pipe.encode_image(row[0], device).float().cpu())
        condition = {"condition_latents": torch.cat(conds)}
        if self.image_embeds:
            condition["condition_image_embeds"] = torch.cat(embeds)
        return condition, [None] * len(images)


def wan_i2v_adapter(base: WanAdapter, model: torch.nn.Module, kind: str, pipe: Any) -> WanI2VAdapter:
    """The I2V adapter over ``base`` (Wan's text-to-video adapter at the output's latent grid): the noisy latents
    have the model's ``out_channels`` (its input adds the condition's); ``pipe``: the pipeline (its VAE's scales)."""
    config = model.config
    image_embeds = config.image_dim is not None
    if image_embeds and base.text_len != WAN_I2V_TEXT_LEN:
        raise ValueError(
            f"text.max_sequence_length={base.text_len}: Wan2.1 I2V's attention takes the last {WAN_I2V_TEXT_LEN} text "
            f"rows as the text and the rows before them as the image (diffusers' WanAttnProcessor); fix: "
            f"text.max_sequence_length={WAN_I2V_TEXT_LEN}"
        )
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    fields["channels"] = config.out_channels
    scale = (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial)
    return WanI2VAdapter(
        **fields, expand_timesteps=kind == "wan-ti2v", image_embeds=image_embeds, vae_scale=scale
    )
