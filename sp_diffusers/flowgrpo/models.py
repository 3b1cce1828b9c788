"""How FlowGRPO calls each transformer family: latents + sigma + text -> forward kwargs.

A rollout works on token latents ``[B, L, C]`` (Qwen-Image/Flux pack 2x2 latent patches into tokens);
the adapter knows the family's forward signature and the extra arguments (image grid, ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QwenImageAdapter", "SD3Adapter", "build_adapter"]


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

    def reward_view(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as ``[B, L, C]`` tokens (what the built-in rewards read)."""
        return latents

    def inputs(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        pooled: torch.Tensor | None = None,
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


@dataclass(frozen=True)
class SD3Adapter:
    """``SD3Transformer2DModel``: latents ``[B, C, H, W]``, timestep = sigma * 1000, pooled text from the
    pipeline's CLIP encoders when the text encoder gives it, else the masked mean of the embeddings.

    SD3 has no text mask of its own; the padded text keys are masked through ``joint_attention_kwargs``,
    which sp_diffusers' SD3 processor (``sp_diffusers.plans``) honours, so padding to the SP degree is exact.
    """

    height: int
    width: int
    channels: int
    patch: int

    @property
    def tokens(self) -> int:
        return (self.height // self.patch) * (self.width // self.patch)

    def latent_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.channels, self.height, self.width)

    def reward_view(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, H*W, C]

    def inputs(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        pooled: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        batch = latents.shape[0]
        if pooled is None:
            weights = mask.to(embeds.dtype)[..., None]
            pooled = (embeds * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        pooled = pooled.to(embeds.dtype)
        return dict(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=(sigma * 1000.0).to(latents.dtype).expand(batch),
            joint_attention_kwargs={"encoder_hidden_states_mask": mask},
        )


def build_adapter(
    model: torch.nn.Module, image_size: int, pooled_from_encoder: bool = False
) -> QwenImageAdapter | SD3Adapter:
    """The adapter for ``model`` at latent size ``image_size`` x ``image_size`` (before patching);
    ``pooled_from_encoder``: the text encoder supplies SD3's pooled projection input itself."""
    from ..compat import diffusers_version
    from ..model_kinds import class_name

    name = class_name(model)
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
    if name == "SD3Transformer2DModel":
        if image_size % config.patch_size:
            raise ValueError(
                f"model.image_size={image_size} must be a multiple of the patch size {config.patch_size}"
            )
        if not pooled_from_encoder and config.joint_attention_dim != config.pooled_projection_dim:
            raise ValueError(
                f"the FlowGRPO SD3 adapter pools the text embeddings ({config.joint_attention_dim}) into "
                f"pooled_projections ({config.pooled_projection_dim}); they must be equal, or encode prompts with "
                "the pipeline's own text encoders (text.pipeline=<pipeline folder>), which give the pooled input"
            )
        return SD3Adapter(image_size, image_size, config.in_channels, config.patch_size)
    raise ValueError(
        f"FlowGRPO has no adapter for {name} yet; supported: QwenImageTransformer2DModel, SD3Transformer2DModel "
        "(add one in sp_diffusers/flowgrpo/models.py)"
    )
