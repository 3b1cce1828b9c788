"""The models the planner knows by name, as facts: each released checkpoint's transformer ``config.json``, its
family's VAE compression and patch sizes (which turn pixels into tokens) and its usual text length.

Nothing is downloaded. Sources (read when this file was written):
- transformer configs: the ``transformer/config.json`` of each Hugging Face repository named in ``source``, as
  diffusers' conversion scripts write them (``scripts/convert_wan_to_diffusers.py``,
  ``convert_hunyuan_video_to_diffusers.py``, ``convert_hunyuan_video1_5_to_diffusers.py`` (720p_t2v: target_size
  960, task_type t2v; the rest are the class defaults), ``convert_cogvideox_to_diffusers.py`` (1.0),
  ``convert_ltx_to_diffusers.py``, ``convert_flux2_to_diffusers.py`` (FLUX.2 [klein] 4B, [dev]),
  ``convert_ltx2_to_diffusers.py`` (version 2.0: LTX-2)); the values equal the released config.json files.
- VAE compression: the VAE class defaults in diffusers (``AutoencoderKLWan`` 8x spatial / 4x temporal,
  ``AutoencoderKLHunyuanVideo`` 8 / 4, ``AutoencoderKLHunyuanVideo15`` 16 / 4, ``AutoencoderKLLTXVideo`` 32 / 8,
  ``AutoencoderKLLTX2Video`` 32 / 8 (LTX-2's, as its conversion script writes it),
  ``AutoencoderKLCogVideoX`` 8 / 4; Qwen-Image, FLUX.1, FLUX.2 (``AutoencoderKLFlux2``) and SD3 8x spatial).
- text lengths: the ``max_sequence_length`` defaults of each pipeline's ``__call__`` (Wan 512, Qwen-Image 512
  (its cap), FLUX 512, HunyuanVideo 256, HunyuanVideo-1.5 1000 (MLLM; the byT5 stream is half of it here),
  SD3 77 CLIP + 256 T5 = 333, LTX-Video 128, CogVideoX 226, Z-Image 512 (its cap: the chat-templated prompt's
  valid tokens, fewer for a short prompt), FLUX.2 512 (padded: every row seen), LTX-2 1024 (its connectors' learnable registers fill the padding: every
  row seen, in each of its two text streams)).
- LTX-2's audio: ``LTX2Pipeline`` makes ``round(frames / frame_rate x 25)`` audio latents (one token each, beside
  the video's) at its default 24 fps; 25 a second is the transformer config's ``audio_sampling_rate /
  audio_hop_length / audio_scale_factor`` (16000 / 160 / 4, the audio VAE's), which ``shapes.py`` reads.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..families.kinds import KINDS
from .released_configs import (
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX_DEV,
    LTX_2,
    QWEN_IMAGE,
    QWEN_IMAGE_2512,
    WAN_14B,
    Z_IMAGE_TURBO,
)

__all__ = ["BUILTIN", "Family", "ModelSpec", "PlanError", "resolve_model"]


class PlanError(ValueError):
    """A planner input that cannot work; the message names the value and the fix."""


@dataclass(frozen=True)
class Family:
    """How a family's pixels become transformer tokens, and its text length."""

    kind: str  # sp_diffusers.families.kinds kind
    vae_spatial: int  # pixels per latent pixel, each spatial axis
    vae_temporal: int  # frames per latent frame (1: images); latent frames = (frames - 1) // t + 1
    patch: int  # latent pixels per token, each spatial axis
    patch_t: int  # latent frames per token
    text_len: int  # text tokens the pipeline passes (padded or capped length)
    video: bool

    @property
    def pixel_multiple(self) -> int:
        """Height and width must be multiples of this."""
        return self.vae_spatial * self.patch


FAMILIES: dict[str, Family] = {
    "wan": Family("wan", 8, 4, 2, 1, 512, True),
    "qwenimage": Family("qwenimage", 8, 1, 2, 1, 512, False),
    "flux": Family("flux", 8, 1, 2, 1, 512, False),
    "hunyuanvideo": Family("hunyuanvideo", 8, 4, 2, 1, 256, True),
    "hunyuanvideo15": Family("hunyuanvideo15", 16, 4, 1, 1, 1000, True),
    "sd3": Family("sd3", 8, 1, 2, 1, 333, False),
    "ltx": Family("ltx", 32, 8, 1, 1, 128, True),
    "cogvideox": Family("cogvideox", 8, 4, 2, 1, 226, True),
    "zimage": Family("zimage", 8, 1, 2, 1, 512, False),
    "flux2": Family("flux2", 8, 1, 2, 1, 512, False),  # the pipelines pack 2 x 2 latents per token
    "ltx2": Family("ltx2", 32, 8, 1, 1, 1024, True),  # plus an audio stream (shapes.py: Workload.audio_tokens)
}


@dataclass(frozen=True)
class ModelSpec:
    """A transformer to plan for: its diffusers class (by kind), constructor config and family facts."""

    name: str
    kind: str
    config: dict[str, Any]
    family: Family
    experts: int = 1  # Wan2.2-A14B: two transformers of this config (high- and low-noise experts)
    source: str = ""
    default_size: tuple[int, int, int] = (1024, 1024, 1)  # height, width, frames
    notes: tuple[str, ...] = field(default_factory=tuple)
    # an image condition (cond_specs.py): "edit" (a condition image's tokens join the sequence, as many as the
    # output's), "i2v" (first frame + mask as channels; CLIP tokens where image_dim), "ti2v" (per-token timesteps)
    condition: str = ""
    # an edit's condition images, each at the output's size (plan --condition-images; Qwen-Image-Edit-Plus: 1 to 3)
    condition_images: int = 1
    max_condition_images: int = 1

    @property
    def class_name(self) -> str:
        return KINDS[self.kind]


BUILTIN: dict[str, ModelSpec] = {
    "wan2.1-t2v-1.3b": ModelSpec(
        "wan2.1-t2v-1.3b",
        "wan",
        {**WAN_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
        FAMILIES["wan"],
        source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        default_size=(480, 832, 81),
    ),
    "wan2.1-t2v-14b": ModelSpec(
        "wan2.1-t2v-14b",
        "wan",
        dict(WAN_14B),
        FAMILIES["wan"],
        source="Wan-AI/Wan2.1-T2V-14B-Diffusers",
        default_size=(720, 1280, 81),
    ),
    "wan2.2-t2v-a14b": ModelSpec(
        "wan2.2-t2v-a14b",
        "wan",
        dict(WAN_14B),
        FAMILIES["wan"],
        experts=2,
        source="Wan-AI/Wan2.2-T2V-A14B-Diffusers (transformer/ and transformer_2/: one config each)",
        default_size=(720, 1280, 81),
        notes=(
            "two experts (high-noise, low-noise) trained in the same processes: the step runs one, the "
            "other's sharded parameters and optimizer state stay resident",
        ),
    ),
    "qwen-image": ModelSpec(
        "qwen-image",
        "qwenimage",
        dict(QWEN_IMAGE),
        FAMILIES["qwenimage"],
        source="Qwen/Qwen-Image",
        default_size=(1328, 1328, 1),
    ),
    "qwen-image-2512": ModelSpec(
        "qwen-image-2512",
        "qwenimage",
        dict(QWEN_IMAGE_2512),
        FAMILIES["qwenimage"],
        source="Qwen/Qwen-Image-2512",
        default_size=(1328, 1328, 1),
    ),
    "z-image-turbo": ModelSpec(
        "z-image-turbo",
        "zimage",
        dict(Z_IMAGE_TURBO),
        FAMILIES["zimage"],
        source="Tongyi-MAI/Z-Image-Turbo",
        default_size=(1024, 1024, 1),
    ),
    "flux.2-klein-4b": ModelSpec(
        "flux.2-klein-4b",
        "flux2",
        dict(FLUX2_KLEIN_4B),
        FAMILIES["flux2"],
        source="black-forest-labs/FLUX.2-klein-4B",
        default_size=(1024, 1024, 1),
    ),
    "flux.2-dev": ModelSpec(
        "flux.2-dev",
        "flux2",
        dict(FLUX2_DEV),
        FAMILIES["flux2"],
        source="black-forest-labs/FLUX.2-dev",
        default_size=(1024, 1024, 1),
    ),
    "flux.1-dev": ModelSpec(
        "flux.1-dev",
        "flux",
        dict(FLUX_DEV),
        FAMILIES["flux"],
        source="black-forest-labs/FLUX.1-dev",
        default_size=(1024, 1024, 1),
    ),
    "hunyuanvideo": ModelSpec(
        "hunyuanvideo",
        "hunyuanvideo",
        {
            "in_channels": 16,
            "out_channels": 16,
            "num_attention_heads": 24,
            "attention_head_dim": 128,
            "num_layers": 20,
            "num_single_layers": 40,
            "num_refiner_layers": 2,
            "mlp_ratio": 4.0,
            "patch_size": 2,
            "patch_size_t": 1,
            "qk_norm": "rms_norm",
            "guidance_embeds": True,
            "text_embed_dim": 4096,
            "pooled_projection_dim": 768,
            "rope_theta": 256.0,
            "rope_axes_dim": (16, 56, 56),
        },
        FAMILIES["hunyuanvideo"],
        source="hunyuanvideo-community/HunyuanVideo",
        default_size=(720, 1280, 129),
    ),
    "hunyuanvideo-1.5": ModelSpec(
        "hunyuanvideo-1.5",
        "hunyuanvideo15",
        {
            "in_channels": 65,
            "out_channels": 32,
            "num_attention_heads": 16,
            "attention_head_dim": 128,
            "num_layers": 54,
            "num_refiner_layers": 2,
            "mlp_ratio": 4.0,
            "patch_size": 1,
            "patch_size_t": 1,
            "qk_norm": "rms_norm",
            "text_embed_dim": 3584,
            "text_embed_2_dim": 1472,
            "image_embed_dim": 1152,
            "rope_theta": 256.0,
            "rope_axes_dim": (16, 56, 56),
            "target_size": 960,
            "task_type": "t2v",
        },
        FAMILIES["hunyuanvideo15"],
        source="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
        default_size=(720, 1280, 121),
    ),
    "sd3.5-large": ModelSpec(
        "sd3.5-large",
        "sd3",
        {
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 38,
            "attention_head_dim": 64,
            "num_attention_heads": 38,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 2432,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 192,
            "qk_norm": "rms_norm",
        },
        FAMILIES["sd3"],
        source="stabilityai/stable-diffusion-3.5-large",
        default_size=(1024, 1024, 1),
    ),
    "ltx-video": ModelSpec(
        "ltx-video",
        "ltx",
        {
            "in_channels": 128,
            "out_channels": 128,
            "patch_size": 1,
            "patch_size_t": 1,
            "num_attention_heads": 32,
            "attention_head_dim": 64,
            "cross_attention_dim": 2048,
            "num_layers": 28,
            "activation_fn": "gelu-approximate",
            "qk_norm": "rms_norm_across_heads",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-6,
            "caption_channels": 4096,
            "attention_bias": True,
            "attention_out_bias": True,
        },
        FAMILIES["ltx"],
        source="Lightricks/LTX-Video (0.9.x, 2B)",
        default_size=(512, 704, 161),
    ),
    "ltx-2": ModelSpec(
        "ltx-2",
        "ltx2",
        dict(LTX_2),
        FAMILIES["ltx2"],
        source="Lightricks/LTX-2 (2.0, 19B)",
        default_size=(512, 768, 121),
        notes=(
            "video with audio: round(frames / 24 x 25) audio tokens (24 fps, 25 audio latents a second) beside the "
            "video's, in their own 2048-wide stream; sequence parallelism splits both streams",
        ),
    ),
    "cogvideox-5b": ModelSpec(
        "cogvideox-5b",
        "cogvideox",
        {
            "num_attention_heads": 48,
            "attention_head_dim": 64,
            "in_channels": 16,
            "out_channels": 16,
            "time_embed_dim": 512,
            "text_embed_dim": 4096,
            "num_layers": 42,
            "sample_width": 90,
            "sample_height": 60,
            "sample_frames": 49,
            "patch_size": 2,
            "patch_size_t": None,
            "max_text_seq_length": 226,
            "use_rotary_positional_embeddings": True,
            "use_learned_positional_embeddings": False,
        },
        FAMILIES["cogvideox"],
        source="THUDM/CogVideoX-5b",
        default_size=(480, 720, 49),
    ),
}


def _conditioned() -> dict[str, ModelSpec]:
    from .cond_specs import COND_SPECS, CONDITION_IMAGES

    notes = {
        "edit": "the condition image's tokens join the sequence (its pipeline resizes it to ~1 MP: counted at the output's size)",
        "i2v": "the first frame and its mask join the channels; Wan2.1's 257 CLIP tokens precede the text",
        "ti2v": "the first latent frame is the image's; every token has its own timestep",
    }
    families = {**FAMILIES, "wan2.2-5b": Family("wan", 16, 4, 2, 1, 512, True)}  # Wan2.2's own VAE: 16x spatial
    out = {}
    for name, (kind, family, config, condition, experts, source, size) in COND_SPECS.items():
        extra = ("two experts (high-noise, low-noise): the step runs one",) if experts > 1 else ()
        most = CONDITION_IMAGES.get(name, 1)
        if most > 1:
            extra = (*extra, f"1 to {most} condition images a row (plan --condition-images; default {most}, the most)")
        out[name] = ModelSpec(
            name, kind, dict(config), families[family], experts, source, size, (*extra, notes[condition]), condition,
            most, most,
        )
    return out


BUILTIN.update(_conditioned())


def _kind_of_class(class_name: str) -> str | None:
    for kind, name in KINDS.items():
        if name == class_name:
            return kind
    return None


def _from_config_file(path: Path) -> ModelSpec:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(
            f"--model {path}: cannot read it as JSON ({err}); fix: point at a diffusers transformer folder "
            "(with config.json) or its config.json"
        ) from None
    class_name = config.get("_class_name") if isinstance(config, dict) else None
    if not class_name:
        raise PlanError(
            f"--model {path} is not a diffusers transformer config: it has no '_class_name'; fix: point at "
            "the transformer/ folder of a diffusers pipeline (save_pretrained writes its config.json)"
        )
    kind = _kind_of_class(class_name)
    if kind is None or kind not in FAMILIES:
        known = sorted(KINDS[k] for k in FAMILIES)
        raise PlanError(
            f"--model {path} is a {class_name}, which the planner has no family facts for (VAE compression, "
            f"patch size, text length); fix: use one of the classes {known}, or --tokens with a built-in model"
        )
    init = {k: v for k, v in config.items() if not k.startswith("_")}
    return ModelSpec(path.parent.name or str(path), kind, init, FAMILIES[kind], source=str(path))


def resolve_model(model: str) -> ModelSpec:
    """A built-in name (any case), a folder holding a transformer ``config.json``, or that file."""
    key = model.strip().lower()
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = (
                " (a pipeline folder: point at its transformer/ subfolder)"
                if (path / "model_index.json").is_file()
                else ""
            )
            raise PlanError(
                f"--model {model}: the folder has no config.json{hint}; fix: point at a diffusers transformer "
                "folder written by save_pretrained, or use a built-in name"
            )
        return _from_config_file(path / "config.json")
    if path.is_file():
        return _from_config_file(path)
    close = difflib.get_close_matches(key, list(BUILTIN), n=3, cutoff=0.4)
    raise PlanError(
        f"--model {model!r} is neither a built-in model nor a folder/config.json; "
        + (f"did you mean {close}? " if close else "")
        + f"known models: {', '.join(BUILTIN)}"
    )
