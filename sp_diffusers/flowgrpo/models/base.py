"""What every family adapter answers beyond its own forward signature, with the answers of a family that is
conditioned on text alone (an editing or image-to-video adapter overrides them)."""

from __future__ import annotations

import torch

__all__ = ["FamilyAdapter"]


class FamilyAdapter:
    def noisy_output(self, out: torch.Tensor) -> torch.Tensor:
        """The part of the transformer's output that belongs to the noisy latents (all of it here)."""
        return out

    def final_latents(self, latents: torch.Tensor, condition: dict[str, torch.Tensor]) -> torch.Tensor:
        """The latents a denoising run ends with, as the family's pipeline hands them to its VAE."""
        return latents
