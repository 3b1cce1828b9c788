"""How FlowGRPO calls HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``), as ``HunyuanVideo15Pipeline`` (text to
video) calls it.

- Latents: video ``[B, C, F, H, W]`` (``AutoencoderKLHunyuanVideo15``: 16x spatial, 4x temporal compression), kept as
  they are; the VAE decodes ``z / scaling_factor`` (``latent_scale.denormalize``: no shift, no statistics).
- Condition channels: the pipeline concatenates condition latents ``[B, C, F, H, W]`` and a mask ``[B, 1, F, H, W]``
  to the latents, both zeros for text to video; ``in_channels`` is ``2 C + 1``.
- Image stream: ``image_embeds`` of zeros ``[B, 729, image_embed_dim]`` (the pipeline's
  ``vision_num_semantic_tokens``); the model reads all-zero image embeds as text to video and masks those tokens.
- Time: the schedule's timestep as is (0..1000), ``[B]`` in the latents' dtype.
- Text: two streams, each with its own mask (the model puts each sample's valid tokens first and masks the rest):
  the MLLM (Qwen2.5-VL) states ``encoder_hidden_states`` / ``encoder_attention_mask`` and the byT5 glyph states of
  the prompt's quoted text ``encoder_hidden_states_2`` / ``encoder_attention_mask_2`` (the trainer's
  ``prompt_embeds_2`` / ``prompt_embeds_mask_2``, handed to :meth:`HunyuanVideo15Adapter.inputs` as ``text_2``).
  The pipeline pads both to fixed lengths (1000, 256); the trainer keeps each prompt's valid rows only (the engine
  pads a batch with masked zero rows): masked rows never reach the output, so the velocity is the pipeline's.
- Guidance: the pipeline's guider (``ClassifierFreeGuidance``: ``neg + g (pos - neg)`` over the empty negative
  prompt at ``guidance_scale`` g, no CFG at g = 1) is the trainer's ``flowgrpo.cfg_scale`` s = g.
- Output: the velocity itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .decode import VideoLatents

__all__ = ["IMAGE_TOKENS", "HunyuanVideo15Adapter", "hunyuanvideo15_adapter"]

IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: the zero image stream's length


@dataclass(frozen=True)
class HunyuanVideo15Adapter(VideoLatents):
    """``HunyuanVideo15Transformer3DModel`` on ``[B, channels, frames, height, width]`` latents (text to video)."""

    # VideoLatents' frames, height, width, channels (the VAE's latent channels: the model's out_channels), patch
    image_dim: int  # the model's image_embed_dim
    glyph_dim: int  # the model's text_embed_2_dim (byT5's width)
    # one sample per VAE call: diffusers' AutoencoderKLHunyuanVideo15 (0.42) builds its mid-block attention's
    # causal mask [B, L, L], which SDPA broadcasts against [B, 1, L, L] wrongly for B > 1 (an error)
    vae_batch: ClassVar[int] = 1

    def inputs(
        self,
        latents: Tensor,
        timestep: Tensor,
        embeds: Tensor,
        mask: Tensor,
        pooled: Tensor | None = None,
        text_2: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Any]:
        """The forward's kwargs; ``text_2``: the byT5 glyph stream ``([B, T2, D2], [B, T2] mask)``. None: a prompt
        without quoted text, as the pipeline encodes it (no valid glyph token: one masked zero row here)."""
        batch, dtype, device = latents.shape[0], latents.dtype, latents.device
        if text_2 is None:
            embeds_2 = torch.zeros(batch, 1, self.glyph_dim, dtype=dtype, device=device)
            mask_2 = torch.zeros(batch, 1, dtype=torch.bool, device=device)
        else:
            embeds_2, mask_2 = text_2
        for name, e, m in (("prompt_embeds", embeds, mask), ("prompt_embeds_2", embeds_2, mask_2)):
            if e.shape[0] != batch or m.shape != e.shape[:2]:
                raise ValueError(
                    f"HunyuanVideo15Adapter: {name} {tuple(e.shape)} and its mask {tuple(m.shape)} do not match the "
                    f"batch of {batch} latents (mask [B, T] for embeddings [B, T, D])"
                )
        # T2V: zero condition latents and mask channels after the latents (prepare_cond_latents_and_mask)
        zeros = latents.new_zeros((batch, self.channels + 1, *latents.shape[2:]))
        return dict(
            hidden_states=torch.cat([latents, zeros], dim=1),
            timestep=timestep.to(dtype).expand(batch),
            encoder_hidden_states=embeds.to(dtype),
            encoder_attention_mask=mask.to(dtype),  # the pipeline's masks are in the model's dtype
            encoder_hidden_states_2=embeds_2.to(dtype),
            encoder_attention_mask_2=mask_2.to(dtype),
            image_embeds=torch.zeros(batch, IMAGE_TOKENS, self.image_dim, dtype=dtype, device=device),
        )


def hunyuanvideo15_adapter(model: torch.nn.Module, frames: int, height: int, width: int) -> HunyuanVideo15Adapter:
    """The adapter for a HunyuanVideo-1.5 transformer at ``frames`` latent frames of ``height`` x ``width``."""
    config = model.config
    c = config.out_channels
    if config.in_channels != 2 * c + 1:
        raise ValueError(
            f"the FlowGRPO HunyuanVideo-1.5 adapter feeds text-to-video inputs (latents, zero condition latents and a "
            f"zero mask: 2 x {c} + 1 channels); the model has in_channels={config.in_channels}; fix: a "
            "HunyuanVideo15Transformer3DModel with in_channels = 2 x out_channels + 1 (as released)"
        )
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    if frames < 1 or frames % patch[0] or height % patch[1] or width % patch[2]:
        raise ValueError(
            f"model.frames={frames}, model.image_size x image_width={height} x {width} (latents) must be multiples of "
            f"the patch size {patch} (frames, height, width)"
        )
    return HunyuanVideo15Adapter(
        frames, height, width, c, patch, config.image_embed_dim, config.text_embed_2_dim
    )
