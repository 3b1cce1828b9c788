"""How FlowGRPO calls each transformer family: latents + model timestep + text -> forward kwargs (FLUX.1:
``flux.py``; FLUX.2: ``flux2.py``; Z-Image: ``zimage.py``; HunyuanVideo-1.5: ``hunyuan15.py``; LTX-2: ``ltx2.py``).

Latents keep the family's own layout (Qwen-Image, FLUX.1, FLUX.2: packed tokens ``[B, L, C]``; SD3, Z-Image:
``[B, C, H, W]``; Wan: video ``[B, C, F, H, W]``); the adapter knows the forward signature, the extra arguments
(image grid, ids) and how the pipeline hands the schedule's timestep (0..1000 scale) to its transformer.
``reward_view`` gives the rewards channels-last latents (``[B, L, C]`` for images, ``[B, F, H, W, C]`` for video).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .decode import ImageLatents, PackedTokens, VideoLatents, pack_2x2, unpack_2x2
from .flux import FluxAdapter, flux_adapter
from .flux2 import Flux2Adapter, flux2_adapter
from .hunyuan15 import HunyuanVideo15Adapter, hunyuanvideo15_adapter
from .ltx2 import LTX2Adapter, ltx2_adapter, ltx2_audio_frames
from .zimage import ZImageAdapter, zimage_adapter

__all__ = [
    "Flux2Adapter",
    "FluxAdapter",
    "HunyuanVideo15Adapter",
    "LTX2Adapter",
    "QwenImageAdapter",
    "SD3Adapter",
    "WanAdapter",
    "ZImageAdapter",
    "build_adapter",
    "embedded_guidance",
]


@dataclass(frozen=True)
class QwenImageAdapter(PackedTokens):
    """``QwenImageTransformer2DModel``: tokens ``[B, (H/2)(W/2), 4 C]``; the pipeline passes ``timestep / 1000``."""

    needs_txt_seq_lens: bool = False  # diffusers 0.36 sizes the text RoPE from txt_seq_lens

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed tokens -> ``[B, C, 1, H, W]`` for ``AutoencoderKLQwenImage`` (one frame)."""
        return unpack_2x2(latents, self.grid_h, self.grid_w).unsqueeze(2)

    def pixel_layout(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded[:, :, 0]

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.unsqueeze(2)  # [B, 3, H, W] -> one frame

    def from_vae_latents(self, z: torch.Tensor) -> torch.Tensor:
        return pack_2x2(z[:, :, 0])

    def inputs(
        self, latents: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, pooled: Tensor | None = None
    ) -> dict[str, Any]:
        batch = latents.shape[0]
        kwargs: dict[str, Any] = dict(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=timestep.to(latents.dtype).expand(batch) / 1000.0,
            img_shapes=[[(1, self.grid_h, self.grid_w)]] * batch,
        )
        if self.needs_txt_seq_lens:
            kwargs["txt_seq_lens"] = [embeds.shape[1]] * batch
        return kwargs


@dataclass(frozen=True)
class SD3Adapter(ImageLatents):
    """``SD3Transformer2DModel``: latents ``[B, C, H, W]``, the schedule's timestep as is, pooled text from the
    pipeline's CLIP encoders when the text encoder gives it, else the masked mean of the embeddings.

    SD3 has no text mask of its own; the padded text keys are masked through ``joint_attention_kwargs``,
    which sp_diffusers' SD3 processor (``sp_diffusers.patching.plans``) honours, so padding to the SP degree is exact.
    """

    def inputs(
        self, latents: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, pooled: Tensor | None = None
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
            timestep=timestep.to(latents.dtype).expand(batch),
            joint_attention_kwargs={"encoder_hidden_states_mask": mask},
        )


@dataclass(frozen=True)
class WanAdapter(VideoLatents):
    """``WanTransformer3DModel``: video latents ``[B, C, F, H, W]``, the schedule's timestep as is (``[B]``).

    Wan's transformer takes no text mask: its pipeline zero-pads every prompt's embeddings to
    ``max_sequence_length`` and the cross-attention attends to those zero rows too (they become non-zero
    tokens after the text projection). So the text the model sees must not depend on how the batch was
    padded: masked positions are zeroed (as verl-omni's Wan adapter does) and the text is cut or zero-padded to
    exactly ``text_len`` rows. The engine's SP padding (to a multiple of the degree) therefore changes nothing,
    and Wan does not shard the text anyway (its plan splits only the video tokens).
    """

    text_len: int

    def inputs(
        self, latents: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, pooled: Tensor | None = None
    ) -> dict[str, Any]:
        batch = latents.shape[0]
        text = embeds * mask.to(embeds.dtype)[..., None]
        if text.shape[1] >= self.text_len:
            text = text[:, : self.text_len]
        else:
            text = torch.nn.functional.pad(text, (0, 0, 0, self.text_len - text.shape[1]))
        return dict(
            hidden_states=latents,
            timestep=timestep.to(latents.dtype).expand(batch),
            encoder_hidden_states=text,
        )


# the pipeline that runs a guidance-distilled transformer where no model.pipeline folder names one
_GUIDED_PIPELINES = {"FluxTransformer2DModel": "FluxPipeline", "Flux2Transformer2DModel": "Flux2Pipeline"}


def embedded_guidance(model_name: str, guidance_scale: float, pipeline: str = "") -> float:
    """``flowgrpo.guidance_scale`` for a guidance embedding; 0: the ``guidance_scale`` default of the pipeline that
    runs the model (``pipeline``'s class, else FluxPipeline / Flux2Pipeline), so a run trains the guidance a user
    samples with: 3.5 for FLUX.1-dev, 4 for FLUX.2 [dev]."""
    import inspect

    import diffusers

    if guidance_scale > 0:
        return guidance_scale
    if guidance_scale < 0:
        raise ValueError(f"flowgrpo.guidance_scale={guidance_scale:g}: > 0, or 0 for the pipeline's own default")
    name = _GUIDED_PIPELINES.get(model_name, "FluxPipeline")
    if pipeline:
        from .folder_checks import read_index

        name = read_index(pipeline).get("_class_name", name)
    call = getattr(diffusers, name).__call__
    return float(inspect.signature(call).parameters["guidance_scale"].default)


def build_adapter(
    model: torch.nn.Module,
    image_size: int,
    pooled_from_encoder: bool = False,
    frames: int = 1,
    text_len: int = 512,
    guidance_scale: float = 0.0,
    image_width: int = 0,
    audio_frames: int = 0,
    frame_rate: float = 24.0,
    pipeline: str = "",
) -> (
    QwenImageAdapter
    | SD3Adapter
    | WanAdapter
    | FluxAdapter
    | Flux2Adapter
    | ZImageAdapter
    | HunyuanVideo15Adapter
    | LTX2Adapter
):
    """The adapter for ``model`` at latent height ``image_size`` and width ``image_width`` (0: ``image_size``; before
    patching), ``frames`` latent frames for video; ``pooled_from_encoder``: the text encoder supplies SD3's pooled
    projection input itself; ``text_len``: the text length a Wan, FLUX.1 or FLUX.2 pipeline pads prompts to
    (``text.max_sequence_length``); ``guidance_scale``: FLUX.1-dev's and FLUX.2 [dev]'s embedded guidance
    (``flowgrpo.guidance_scale``; 0: :func:`embedded_guidance`'s pipeline default); LTX-2: ``audio_frames`` latent audio frames (0: as ``pipeline``'s ``__call__`` gives
    ``frames`` at ``frame_rate``), ``frame_rate`` the video's (its positions are conditioned on it)."""
    from ...families.kinds import class_name
    from ...patching.compat import diffusers_version

    name = class_name(model)
    config = model.config
    h, w = image_size, image_width or image_size

    def check(patch_h: int, patch_w: int) -> None:
        if h % patch_h or w % patch_w:
            what = f"model.image_size={h} x model.image_width={w}" if image_width else f"model.image_size={h}"
            raise ValueError(
                f"{what} must be a multiple of the patch size {patch_h if patch_h == patch_w else (patch_h, patch_w)} "
                "(the latent height x width; "
                "FLUX.1, FLUX.2: 2 x 2, their pipelines pack 2 x 2 latents into a token)"
            )

    if name == "QwenImageTransformer2DModel":
        check(config.patch_size, config.patch_size)
        return QwenImageAdapter(
            grid_h=h // config.patch_size,
            grid_w=w // config.patch_size,
            channels=config.in_channels,
            needs_txt_seq_lens=diffusers_version().release < (0, 37),
        )
    if name == "FluxTransformer2DModel":
        check(2, 2)  # FluxPipeline packs 2 x 2 latents into one token
        guidance = embedded_guidance(name, guidance_scale, pipeline)
        return flux_adapter(model, h, w, pooled_from_encoder, text_len, guidance)
    if name == "Flux2Transformer2DModel":
        check(2, 2)  # the FLUX.2 pipelines pack 2 x 2 latents into one token
        return flux2_adapter(model, h, w, text_len, embedded_guidance(name, guidance_scale, pipeline))
    if name == "SD3Transformer2DModel":
        check(config.patch_size, config.patch_size)
        if not pooled_from_encoder and config.joint_attention_dim != config.pooled_projection_dim:
            raise ValueError(
                f"the FlowGRPO SD3 adapter pools the text embeddings ({config.joint_attention_dim}) into "
                f"pooled_projections ({config.pooled_projection_dim}); they must be equal, or encode prompts with "
                "the pipeline's own text encoders (text.pipeline=<pipeline folder>), which give the pooled input"
            )
        return SD3Adapter(h, w, config.in_channels, config.patch_size)
    if name == "WanTransformer3DModel":
        pt, ph, pw = config.patch_size
        check(ph, pw)
        if frames < 1 or frames % pt:
            raise ValueError(
                f"model.frames={frames} must be a positive multiple of the temporal patch size {pt} (latent frames)"
            )
        if text_len < 1:
            raise ValueError(f"text.max_sequence_length={text_len} must be >= 1 (Wan pads prompts to it)")
        return WanAdapter(frames, h, w, config.in_channels, (pt, ph, pw), text_len)
    if name == "ZImageTransformer2DModel":
        check(2, 2)  # ZImagePipeline calls the transformer with patch_size 2
        return zimage_adapter(model, h, w)
    if name == "HunyuanVideo15Transformer3DModel":
        return hunyuanvideo15_adapter(model, frames, h, w)
    if name == "LTX2VideoTransformer3DModel":
        if audio_frames == 0:
            if not pipeline:
                raise ValueError(
                    "model.audio_frames=0 asks for the LTX2Pipeline's own audio length, but there is no model.pipeline "
                    "to read it from; fix: model.audio_frames=<latent audio frames> (25 a second at 16 kHz)"
                )
            audio_frames = ltx2_audio_frames(pipeline, frames, frame_rate)
        return ltx2_adapter(model, frames, h, w, audio_frames, frame_rate)
    raise ValueError(
        f"FlowGRPO has no adapter for {name} yet; supported: QwenImageTransformer2DModel, FluxTransformer2DModel, "
        "Flux2Transformer2DModel, SD3Transformer2DModel, WanTransformer3DModel, ZImageTransformer2DModel, "
        "HunyuanVideo15Transformer3DModel, LTX2VideoTransformer3DModel (add one in "
        "sp_diffusers/flowgrpo/models/adapters.py)"
    )
