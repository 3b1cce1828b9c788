"""Tiny diffusers pipelines written with ``save_pretrained``: the real loading paths, nothing downloaded.

Every pipeline holds the real classes its released checkpoint holds (transformer(s), text encoder(s), tokenizer(s),
scheduler with the released scheduler config, VAE), with small configs and fixed seeds (``text_parts.py``), so
``DiffusionPipeline.from_pretrained``, ``encode_prompt``, the schedule, VAE decoding and ``__call__`` all run as with
the real checkpoint. Each VAE compresses 2x spatially (latent 8 x 8 -> 16 x 16 pixels; Wan also 2x in time).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..families.scheduler_configs import scheduler_kwargs
from .specs import tiny_model
from .text_parts import (
    char_tokenizer,
    chat_tokenizer,
    flux_parts,
    mistral_chat_tokenizer,
    save_pipeline,
    tiny_autoencoder_kl,
    tiny_clip_text,
    tiny_flux2_vae,
    tiny_gemma3,
    tiny_hunyuanvideo15_vae,
    tiny_ltx2_audio_vae,
    tiny_ltx2_connectors,
    tiny_ltx2_vae,
    tiny_ltx2_vocoder,
    tiny_mistral3,
    tiny_qwen3,
    tiny_qwen25vl,
    tiny_qwen25vl_text,
    tiny_qwenimage_vae,
    tiny_t5,
    tiny_umt5,
    tiny_wan_vae,
)

__all__ = [
    "LTX2_MAX_SEQUENCE_LENGTH",
    "PIPELINE_WRITERS",
    "WAN_SCHEDULER_CONFIG",
    "save_tiny_flux2_dev_pipeline",
    "save_tiny_flux2_klein_pipeline",
    "save_tiny_flux_pipeline",
    "save_tiny_hunyuanvideo15_pipeline",
    "save_tiny_ltx2_pipeline",
    "save_tiny_pipeline",
    "save_tiny_qwenimage_pipeline",
    "save_tiny_sd3_pipeline",
    "save_tiny_wan_pipeline",
    "save_tiny_zimage_pipeline",
    "tiny_umt5",
]

# Wan2.1-T2V-1.3B-Diffusers' scheduler_config.json (UniPC, flow sigmas, flow_shift 3)
WAN_SCHEDULER_CONFIG = scheduler_kwargs("wan")


def save_tiny_sd3_pipeline(folder: str | os.PathLike, seed: int = 0, **transformer_overrides: Any) -> Path:
    """A tiny ``StableDiffusion3Pipeline``: the tiny SD3 transformer, two ``CLIPTextModelWithProjection`` (16 wide,
    pooled 16 + 16 = the transformer's pooled_projection_dim), a ``T5EncoderModel`` (32 = its joint_attention_dim),
    character tokenizers, an ``AutoencoderKL`` (SD3's scaling and shift factors) and SD3's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    transformer = tiny_model("sd3", seed=seed, **transformer_overrides)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("sd3")),
        vae=tiny_autoencoder_kl(seed + 3, transformer.config.in_channels, 1.5305, 0.0609),
        text_encoder=tiny_clip_text(seed),
        tokenizer=char_tokenizer(77),
        text_encoder_2=tiny_clip_text(seed + 1),
        tokenizer_2=char_tokenizer(77),
        text_encoder_3=tiny_t5(seed + 2, transformer.config.joint_attention_dim),
        tokenizer_3=char_tokenizer(512),
    )
    return save_pipeline(pipe, folder)


def save_tiny_qwenimage_pipeline(folder: str | os.PathLike, seed: int = 0, **transformer_overrides: Any) -> Path:
    """A tiny ``QwenImagePipeline``: the tiny Qwen-Image transformer, a ``Qwen2_5_VLForConditionalGeneration`` text
    encoder (32 wide = joint_attention_dim) with a character tokenizer, an ``AutoencoderKLQwenImage`` (z = in_channels
    / 4: the pipeline packs 2 x 2 latents into one token) and Qwen-Image's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    transformer = tiny_model("qwenimage", seed=seed, **transformer_overrides)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("qwenimage")),
        vae=tiny_qwenimage_vae(seed + 2, transformer.config.in_channels // 4),
        text_encoder=tiny_qwen25vl(seed + 1, transformer.config.joint_attention_dim),
        tokenizer=char_tokenizer(1024 + 34),
        transformer=transformer,
    )
    return save_pipeline(pipe, folder)


def save_tiny_flux_pipeline(
    folder: str | os.PathLike, seed: int = 0, guidance_embeds: bool = True, **transformer_overrides: Any
) -> Path:
    """A tiny ``FluxPipeline`` shaped as FLUX.1-dev: the tiny Flux transformer with a guidance embedding
    (``guidance_embeds``; FLUX.1-schnell has none), a ``CLIPTextModel`` (pooled 16 = pooled_projection_dim) and a
    ``T5EncoderModel`` (32 = joint_attention_dim) with character tokenizers, an ``AutoencoderKL`` (Flux's scaling
    and shift; latent channels = in_channels / 4, packed 2 x 2 by the pipeline) and FLUX.1-dev's scheduler config."""
    from diffusers import FluxPipeline

    transformer = tiny_model("flux", seed=seed, guidance_embeds=guidance_embeds, **transformer_overrides)
    return save_pipeline(FluxPipeline(transformer=transformer, **flux_parts(seed, transformer)), folder)


def save_tiny_wan_pipeline(
    folder: str | os.PathLike, seed: int = 0, experts: int = 1, boundary_ratio: float = 0.875, **transformer_overrides: Any
) -> Path:
    """A tiny ``WanPipeline``: the tiny ``WanTransformer3DModel`` (text_dim 32), a ``UMT5EncoderModel`` (d_model 32)
    with a ``ByT5Tokenizer``, an ``AutoencoderKLWan`` (z = the transformer's channels) and Wan2.1's scheduler config.

    ``experts=2`` writes Wan2.2-A14B's layout: a second transformer (``transformer_2``, other weights: the low-noise
    expert) and ``boundary_ratio`` (A14B T2V: 0.875) in the pipeline config; ``WanPipeline`` runs ``transformer`` at
    timesteps >= ``boundary_ratio * num_train_timesteps`` and ``transformer_2`` below."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    if experts not in (1, 2):
        raise ValueError(f"experts={experts!r}: a WanPipeline has 1 (Wan2.1) or 2 (Wan2.2-A14B) transformers")
    transformer = tiny_model("wan", seed=seed, **transformer_overrides)
    tokenizer, text_encoder = tiny_umt5(seed=seed + 1, d_model=transformer.config.text_dim)
    extra: dict[str, Any] = {}
    if experts == 2:
        extra = dict(transformer_2=tiny_model("wan", seed=seed + 10, **transformer_overrides), boundary_ratio=boundary_ratio)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=tiny_wan_vae(seed + 2, transformer.config.in_channels),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        transformer=transformer,
        **extra,
    )
    return save_pipeline(pipe, folder)


def save_tiny_zimage_pipeline(
    folder: str | os.PathLike, seed: int = 0, num_layers: int | None = None, **transformer_overrides: Any
) -> Path:
    """A tiny ``ZImagePipeline`` shaped as Z-Image-Turbo: the tiny ``ZImageTransformer2DModel`` with 16 input
    channels (the VAE's latent channels, as the released model) and a RoPE table long enough for the pipeline's
    default 512 caption tokens (caption positions come first on axis 0, the image after them), a ``Qwen3Model`` text
    encoder (hidden = ``cap_feat_dim``) with a character tokenizer and a Qwen-style chat template, an
    ``AutoencoderKL`` with the FLUX.1 VAE's scaling and shift (the VAE Z-Image ships) and Z-Image-Turbo's scheduler
    config. ``num_layers``: the main layers (the model's ``n_layers``; the same keyword as the other writers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    overrides: dict[str, Any] = {"in_channels": 16, "axes_lens": [1024, 64, 64], **transformer_overrides}
    if num_layers is not None:
        overrides["n_layers"] = num_layers
    transformer = tiny_model("zimage", seed=seed, **overrides)
    cfg = transformer.config
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("zimage")),
        vae=tiny_autoencoder_kl(seed + 2, cfg.in_channels, 0.3611, 0.1159),
        text_encoder=tiny_qwen3(seed + 1, cfg.cap_feat_dim),
        tokenizer=chat_tokenizer(1024),
        transformer=transformer,
    )
    return save_pipeline(pipe, folder)


def save_tiny_flux2_klein_pipeline(
    folder: str | os.PathLike,
    seed: int = 0,
    is_distilled: bool = False,
    text_hidden: int = 16,
    **transformer_overrides: Any,
) -> Path:
    """A tiny ``Flux2KleinPipeline`` shaped as FLUX.2 [klein] 4B: the tiny ``Flux2Transformer2DModel`` without a
    guidance embedding (as released), ``in_channels`` = 4 x the VAE's latent channels (the pipeline packs each 2 x 2
    patch of the ``AutoencoderKLFlux2`` latents into one token: released 4 x 32 = 128) and ``joint_attention_dim``
    = 3 x the text width (the pipeline stacks Qwen3's hidden states 9, 18 and 27: released 3 x 2560 = 7680); a
    28-layer ``Qwen3ForCausalLM`` ``text_hidden`` wide with a character tokenizer and a Qwen-style chat template;
    FLUX.2's scheduler config. ``is_distilled``: the step-distilled [klein] (the pipeline then runs no CFG at any
    ``guidance_scale``); False: [klein] Base, which guides with CFG at ``guidance_scale > 1``."""
    import diffusers

    if not hasattr(diffusers, "Flux2KleinPipeline"):
        raise ValueError(
            f"save_tiny_flux2_klein_pipeline: diffusers {diffusers.__version__} has no Flux2KleinPipeline (added in "
            "0.37); fix: diffusers >= 0.37"
        )
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    overrides: dict[str, Any] = {"guidance_embeds": False, "joint_attention_dim": 3 * text_hidden}
    overrides.update(transformer_overrides)
    transformer = tiny_model("flux2", seed=seed, **overrides)
    cfg = transformer.config
    if cfg.in_channels % 4 or cfg.joint_attention_dim != 3 * text_hidden:
        raise ValueError(
            f"save_tiny_flux2_klein_pipeline: in_channels={cfg.in_channels} must be 4 x the VAE's latent channels and "
            f"joint_attention_dim={cfg.joint_attention_dim} must be 3 x text_hidden={text_hidden} (three stacked "
            "Qwen3 layers); fix: in_channels a multiple of 4, joint_attention_dim left out"
        )
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("flux2")),
        vae=tiny_flux2_vae(seed + 2, cfg.in_channels // 4),
        text_encoder=tiny_qwen3(seed + 1, text_hidden, layers=28, causal_lm=True),
        tokenizer=chat_tokenizer(1024),
        transformer=transformer,
        is_distilled=is_distilled,
    )
    return save_pipeline(pipe, folder)


def save_tiny_flux2_dev_pipeline(
    folder: str | os.PathLike, seed: int = 0, text_hidden: int = 16, **transformer_overrides: Any
) -> Path:
    """A tiny ``Flux2Pipeline`` shaped as FLUX.2 [dev]: the tiny ``Flux2Transformer2DModel`` with its guidance
    embedding (guidance-distilled, as released: the pipeline passes ``guidance_scale`` as an input and runs no CFG),
    ``in_channels`` = 4 x the VAE's latent channels, ``joint_attention_dim`` = 3 x the text width (the pipeline
    stacks Mistral3's hidden states 10, 20 and 30: released 3 x 5120 = 15360); a 30-layer
    ``Mistral3ForConditionalGeneration`` ``text_hidden`` wide with a character tokenizer and a Mistral-style chat
    template (:func:`mistral_chat_tokenizer`; the released folder holds Mistral's processor, which needs
    torchvision); FLUX.2's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    overrides: dict[str, Any] = {"guidance_embeds": True, "joint_attention_dim": 3 * text_hidden}
    overrides.update(transformer_overrides)
    transformer = tiny_model("flux2", seed=seed, **overrides)
    cfg = transformer.config
    if cfg.in_channels % 4 or cfg.joint_attention_dim != 3 * text_hidden or not cfg.guidance_embeds:
        raise ValueError(
            f"save_tiny_flux2_dev_pipeline: in_channels={cfg.in_channels} must be 4 x the VAE's latent channels, "
            f"joint_attention_dim={cfg.joint_attention_dim} 3 x text_hidden={text_hidden} (three stacked Mistral3 "
            f"layers) and guidance_embeds={cfg.guidance_embeds} true (FLUX.2 [dev] is guidance-distilled); fix: "
            "in_channels a multiple of 4, joint_attention_dim and guidance_embeds left out"
        )
    tokenizer = mistral_chat_tokenizer(1024, SYSTEM_MESSAGE)
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("flux2")),
        vae=tiny_flux2_vae(seed + 2, cfg.in_channels // 4),
        text_encoder=tiny_mistral3(seed + 1, len(tokenizer), text_hidden),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_pipeline(pipe, folder)


def save_tiny_hunyuanvideo15_pipeline(
    folder: str | os.PathLike, seed: int = 0, guidance_scale: float = 6.0, **transformer_overrides: Any
) -> Path:
    """A tiny ``HunyuanVideo15Pipeline`` (text-to-video): the tiny ``HunyuanVideo15Transformer3DModel`` (``in_channels``
    = 2 x the VAE's latent channels + 1: the pipeline concatenates the condition latents and a mask, zeros for T2V),
    a 3-layer ``Qwen2_5_VLTextModel`` ``text_embed_dim`` wide with a chat-template character tokenizer (the MLLM
    stream), a ``T5EncoderModel`` ``text_embed_2_dim`` wide with ``ByT5Tokenizer`` (the glyph stream: quoted text in a
    prompt), an ``AutoencoderKLHunyuanVideo15`` compressing 2x in space and time, HunyuanVideo-1.5's scheduler config
    and a ``ClassifierFreeGuidance`` guider at ``guidance_scale`` (1: no CFG)."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from transformers import ByT5Tokenizer

    transformer = tiny_model("hunyuanvideo15", seed=seed, **transformer_overrides)
    cfg = transformer.config
    if cfg.in_channels != 2 * cfg.out_channels + 1:
        raise ValueError(
            f"save_tiny_hunyuanvideo15_pipeline: in_channels={cfg.in_channels} must be 2 x out_channels + 1 = "
            f"{2 * cfg.out_channels + 1} (latents, condition latents and mask concatenated); fix: set both together"
        )
    byt5 = ByT5Tokenizer()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=tiny_qwen25vl_text(seed + 1, cfg.text_embed_dim),
        tokenizer=chat_tokenizer(2048),
        transformer=transformer,
        vae=tiny_hunyuanvideo15_vae(seed + 2, cfg.out_channels),
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("hunyuanvideo15")),
        text_encoder_2=tiny_t5(seed + 3, cfg.text_embed_2_dim, vocab_size=len(byt5)),
        tokenizer_2=byt5,
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )
    return save_pipeline(pipe, folder)


# The tiny LTX-2 tokenizer's model_max_length (the pipeline's ``tokenizer_max_length``): pass it as
# ``max_sequence_length`` (LTX2Pipeline's default, 1024, also works: both are multiples of the connectors' 8 registers).
LTX2_MAX_SEQUENCE_LENGTH = 64
_LTX2_REGISTERS = 8
_LTX2_AUDIO_LATENT_CHANNELS = 2


def save_tiny_ltx2_pipeline(folder: str | os.PathLike, seed: int = 0, **transformer_overrides: Any) -> Path:
    """A tiny ``LTX2Pipeline`` (LTX-2.0 text-to-audio+video): the tiny ``LTX2VideoTransformer3DModel``, a 2-layer
    ``Gemma3ForConditionalGeneration`` ``caption_channels`` wide with a character tokenizer (left padding to
    ``max_sequence_length``; model_max_length :data:`LTX2_MAX_SEQUENCE_LENGTH`), ``LTX2TextConnectors`` with 8
    learnable registers (``max_sequence_length`` must be a multiple of 8), an ``AutoencoderKLLTX2Video``, an
    ``AutoencoderKLLTX2Audio``, an ``LTX2Vocoder`` and LTX-2's scheduler config; no processor, prompt enhancer or
    duration head (LTX-2.0 has none: ``num_frames`` must then be given, else 121).

    Sizes (``transformer.config.patch_size`` = ``patch_size_t`` = 1, as released):

    * video: the VAE compresses 2x in space and in time, causally (released: 32x, 8x). ``num_frames`` = 1 + 2 k
      pixel frames (any ``num_frames`` works: ``(num_frames - 1) // 2 + 1`` latent frames, decoded back to
      ``2 (that - 1) + 1``); ``height`` and ``width`` multiples of 2. Latents ``[B, in_channels (8), (num_frames - 1)
      // 2 + 1, height // 2, width // 2]``; video tokens = latent frames x latent height x latent width (16 x 16
      pixels, 5 frames: 3 x 8 x 8 = 192 tokens of 8 channels).
    * audio: 16 kHz, hop 160 = 100 mel frames a second, the audio VAE compresses 4x in time and in mel bins, so
      ``audio_vae.config.sample_rate / audio_vae.config.mel_hop_length / audio_vae.temporal_compression_ratio`` = 25
      audio latents a second, as released; the pipeline makes ``round(num_frames / frame_rate * 25)`` of them (one
      audio token each). Audio latents ``[B, 2 (latent_channels), L, 4 (mel_bins 16 / 4)]``, packed to ``[B, L, 2 x
      4 = 8 = audio_in_channels]`` (channel-major: ``latents.transpose(1, 2).flatten(2, 3)``); the audio VAE's
      ``latents_mean`` / ``latents_std`` (8 entries) normalise the packed tokens.
    * waveform: the audio VAE decodes ``L`` latents to ``4 L - 3`` stereo mel frames of 16 bins, the vocoder makes 16
      samples a frame: ``audio`` is ``[B, 2, 16 (4 L - 3)]`` at ``vocoder.config.output_sampling_rate`` = 1600 Hz.

    The trainer concatenates video and audio tokens: ``in_channels`` must equal ``audio_in_channels``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    transformer = tiny_model("ltx2", seed=seed, **transformer_overrides)
    cfg = transformer.config
    patch = cfg.patch_size * cfg.patch_size * cfg.patch_size_t
    if cfg.in_channels % patch or cfg.audio_in_channels % _LTX2_AUDIO_LATENT_CHANNELS:
        raise ValueError(
            f"save_tiny_ltx2_pipeline: in_channels={cfg.in_channels} must be a multiple of patch_size^2 x patch_size_t"
            f" = {patch} and audio_in_channels={cfg.audio_in_channels} of the audio VAE's "
            f"{_LTX2_AUDIO_LATENT_CHANNELS} latent channels; fix: set them to such multiples"
        )
    text_layers = 2
    audio_vae = tiny_ltx2_audio_vae(
        seed + 3, _LTX2_AUDIO_LATENT_CHANNELS, 4 * cfg.audio_in_channels // _LTX2_AUDIO_LATENT_CHANNELS
    )
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_kwargs("ltx2")),
        vae=tiny_ltx2_vae(seed + 2, cfg.in_channels // patch),
        audio_vae=audio_vae,
        text_encoder=tiny_gemma3(seed + 1, cfg.caption_channels, layers=text_layers),
        tokenizer=char_tokenizer(LTX2_MAX_SEQUENCE_LENGTH),
        connectors=tiny_ltx2_connectors(seed + 5, cfg.caption_channels, text_layers, _LTX2_REGISTERS),
        transformer=transformer,
        vocoder=tiny_ltx2_vocoder(seed + 4, audio_vae),
    )
    return save_pipeline(pipe, folder)


# family -> writer: the families the trainer reads from a pipeline folder (wan2.2: save_tiny_wan_pipeline(experts=2))
PIPELINE_WRITERS = {
    "qwenimage": save_tiny_qwenimage_pipeline,
    "flux": save_tiny_flux_pipeline,
    "sd3": save_tiny_sd3_pipeline,
    "wan": save_tiny_wan_pipeline,
    "zimage": save_tiny_zimage_pipeline,
    "flux2-klein": save_tiny_flux2_klein_pipeline,
    "flux2-dev": save_tiny_flux2_dev_pipeline,
    "hunyuanvideo15": save_tiny_hunyuanvideo15_pipeline,
    "ltx2": save_tiny_ltx2_pipeline,
}


def save_tiny_pipeline(family: str, folder: str | os.PathLike, seed: int = 0, **options: Any) -> Path:
    """``save_tiny_<family>_pipeline(folder, seed, **options)``; ``wan2.2`` is ``wan`` with two experts; the
    image-conditioned families (``flux-kontext``, ``qwenimage-edit``, ``qwenimage-edit-plus``, ``wan-i2v``,
    ``wan2.2-i2v``, ``wan2.2-ti2v``) are in ``cond_pipelines.py``."""
    from .cond_pipelines import COND_PIPELINE_WRITERS

    if family == "wan2.2":
        return save_tiny_wan_pipeline(folder, seed, experts=2, **options)
    if family in COND_PIPELINE_WRITERS:
        writer, fixed = COND_PIPELINE_WRITERS[family]
        return writer(folder, seed, **fixed, **options)
    if family not in PIPELINE_WRITERS:
        choices = (*PIPELINE_WRITERS, "wan2.2", *COND_PIPELINE_WRITERS)
        raise ValueError(f"no tiny pipeline for {family!r}; choose one of {choices}")
    return PIPELINE_WRITERS[family](folder, seed, **options)
