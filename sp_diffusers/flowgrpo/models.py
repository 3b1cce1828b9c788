"""How FlowGRPO calls each transformer family: latents + sigma + text -> forward kwargs.

A rollout works on token latents ``[B, L, C]`` (Qwen-Image/Flux pack 2x2 latent patches into tokens);
the adapter knows the family's forward signature and the extra arguments (image grid, ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QwenImageAdapter", "build_adapter"]


@dataclass(frozen=True)
class QwenImageAdapter:
    """``QwenImageTransformer2DModel``: tokens ``[B, (H/2)(W/2), 4 C]``, timestep = sigma in [0, 1]."""

    grid_h: int
    grid_w: int
    channels: int
    needs_txt_seq_lens: bool = False  # diffusers 0.36 sizes the text RoPE from txt_seq_lens

    @property
    def tokens(self) -> int:
        return self.grid_h * self.grid_w

    def latent_shape(self, batch: int) -> tuple[int, int, int]:
        return (batch, self.tokens, self.channels)

    def inputs(
        self, latents: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, Any]:
        batch = latents.shape[0]
        kwargs: dict[str, Any] = dict(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=sigma.to(latents.dtype).expand(batch),
            img_shapes=[[(1, self.grid_h, self.grid_w)]] * batch,
        )
        if self.needs_txt_seq_lens:
            kwargs["txt_seq_lens"] = [embeds.shape[1]] * batch
        return kwargs


def build_adapter(model: torch.nn.Module, image_size: int) -> QwenImageAdapter:
    """The adapter for ``model`` at latent size ``image_size`` x ``image_size`` (before patching)."""
    from ..compat import diffusers_version

    name = type(model).__name__.removeprefix("FSDP")
    config = model.config
    if name == "QwenImageTransformer2DModel":
        patch = config.patch_size
        if image_size % patch:
            raise ValueError(f"model.image_size={image_size} must be a multiple of the patch size {patch}")
        return QwenImageAdapter(
            grid_h=image_size // patch,
            grid_w=image_size // patch,
            channels=config.in_channels,
            needs_txt_seq_lens=diffusers_version().release < (0, 37),
        )
    raise ValueError(
        f"FlowGRPO has no adapter for {name} yet; supported: QwenImageTransformer2DModel "
        "(add one in sp_diffusers/flowgrpo/models.py)"
    )
