"""How FlowGRPO calls FLUX.1 (``FluxTransformer2DModel``), as ``FluxPipeline`` calls it.

- Latents: the pipeline packs each 2 x 2 patch of the VAE latents into one token, ``[B, (H/2)(W/2), 4 C]`` (the
  transformer's own patch size is 1); ``img_ids`` give each token ``(0, row, column)``, ``txt_ids`` are zeros.
- Time: the schedule's timestep divided by 1000 (the transformer scales it back).
- Guidance: FLUX.1-dev is guidance-distilled (``guidance_embeds``): the pipeline passes ``guidance_scale`` (3.5 by
  default) as a per-sample ``guidance`` input instead of running classifier-free guidance; the adapter does the
  same with ``flowgrpo.guidance_scale``. FLUX.1-schnell has no guidance embedding and gets none.
- Text: CLIP's pooled embedding (``pooled_projections``) and T5's states padded to ``max_sequence_length``; the
  transformer has no text mask and attends to every T5 row. So, as for Wan, the text the model sees must not depend
  on how a batch was padded: masked rows are zeroed and the text is cut or zero-padded to ``text_len`` rows (with a
  pipeline's encoder the rows are already ``max_sequence_length`` and all real, so nothing changes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .decode import PackedTokens, pack_2x2, unpack_2x2

__all__ = ["FluxAdapter", "fixed_length", "flux_adapter"]


def fixed_length(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> torch.Tensor:
    """``embeds`` with masked rows zeroed, cut or zero-padded to ``length`` rows (what a maskless transformer sees)."""
    text = embeds * mask.to(embeds.dtype)[..., None]
    if text.shape[1] >= length:
        return text[:, :length]
    return torch.nn.functional.pad(text, (0, 0, 0, length - text.shape[1]))


@dataclass(frozen=True)
class FluxAdapter(PackedTokens):
    text_len: int
    guidance: float | None  # None: the model has no guidance embedding (FLUX.1-schnell)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return unpack_2x2(latents, self.grid_h, self.grid_w)

    def pixel_layout(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels

    def from_vae_latents(self, z: torch.Tensor) -> torch.Tensor:
        return pack_2x2(z)

    def image_ids(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[h w, 3]``: ``(0, row, column)`` of each packed token, as ``FluxPipeline._prepare_latent_image_ids``."""
        rows = torch.arange(self.grid_h, device=device, dtype=dtype)[:, None].expand(self.grid_h, self.grid_w)
        cols = torch.arange(self.grid_w, device=device, dtype=dtype)[None, :].expand(self.grid_h, self.grid_w)
        return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)

    def inputs(
        self, latents: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, pooled: Tensor | None = None
    ) -> dict[str, Any]:
        batch, dtype, device = latents.shape[0], latents.dtype, latents.device
        text = fixed_length(embeds, mask, self.text_len)
        if pooled is None:  # the masked mean of the text (the built-in encoder has no CLIP)
            weights = mask.to(embeds.dtype)[..., None]
            pooled = (embeds * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        kwargs: dict[str, Any] = dict(
            hidden_states=latents,
            encoder_hidden_states=text,
            pooled_projections=pooled.to(dtype),
            timestep=timestep.to(dtype).expand(batch) / 1000.0,
            img_ids=self.image_ids(device, dtype),
            txt_ids=torch.zeros(self.text_len, 3, device=device, dtype=dtype),
        )
        if self.guidance is not None:
            kwargs["guidance"] = torch.full((batch,), self.guidance, device=device, dtype=torch.float32)
        return kwargs


def flux_adapter(
    model: torch.nn.Module, height: int, width: int, pooled_from_encoder: bool, text_len: int, guidance_scale: float
) -> FluxAdapter:
    """The adapter for a FLUX.1 transformer at the VAE's latent ``height`` x ``width`` (both even)."""
    config = model.config
    if config.patch_size != 1:
        raise ValueError(f"the FlowGRPO Flux adapter packs 2 x 2 latents itself; the model's patch_size is {config.patch_size}")
    if not pooled_from_encoder and config.joint_attention_dim != config.pooled_projection_dim:
        raise ValueError(
            f"the FlowGRPO Flux adapter pools the text embeddings ({config.joint_attention_dim}) into "
            f"pooled_projections ({config.pooled_projection_dim}); they must be equal, or encode prompts with the "
            "pipeline's own CLIP and T5 (model.pipeline=<a FluxPipeline folder>), which give the pooled input"
        )
    if text_len < 1:
        raise ValueError(f"text.max_sequence_length={text_len} must be >= 1 (FluxPipeline pads T5 to it)")
    guidance = guidance_scale if config.guidance_embeds else None
    return FluxAdapter(height // 2, width // 2, config.in_channels, text_len, guidance)
