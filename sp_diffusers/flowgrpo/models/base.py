"""What every family adapter answers beyond its own forward signature, with the answers of a family that is
conditioned on text alone (an editing or image-to-video adapter overrides them)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .latent_scale import denormalize, normalize

__all__ = ["FamilyAdapter"]


class FamilyAdapter:
    # the most samples the family's VAE decodes or encodes in one call (None: any; HunyuanVideo-1.5's: 1)
    vae_batch: ClassVar[int | None] = None
    # the text's valid length per row, as host ints beside it (``PromptEncoder``): a family that hands its
    # transformer each caption's valid rows only (Z-Image) cuts them without reading a mask on the device
    host_text_lengths: ClassVar[bool] = False

    @property
    def audio_tokens(self) -> int:
        """The tokens of an audio stream beside the image / video tokens (none here; LTX-2's)."""
        return 0

    def noisy_output(self, out: torch.Tensor) -> torch.Tensor:
        """The part of the transformer's output that belongs to the noisy latents (all of it here)."""
        return out

    def final_latents(self, latents: torch.Tensor, condition: dict[str, torch.Tensor]) -> torch.Tensor:
        """The latents a denoising run ends with, as the family's pipeline hands them to its VAE."""
        return latents

    def to_vae(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """The trainer's latents -> what ``vae.decode`` takes, as the family's pipeline prepares them: its layout
        (``vae_latents``), then the VAE config's normalisation undone (``latent_scale.denormalize``). FLUX.2
        overrides it (batch-norm statistics over the packed channels)."""
        return denormalize(vae, self.vae_latents(latents))

    def decode_kwargs(self, vae: Any, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """What ``vae.decode`` takes beside the latents (none here; LTX-2's timestep-conditioned VAE: ``temb``)."""
        return {}

    def from_vae(self, vae: Any, z: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_vae`: a VAE posterior's latents -> the trainer's (normalised, in its layout)."""
        return self.from_vae_latents(normalize(vae, z))
