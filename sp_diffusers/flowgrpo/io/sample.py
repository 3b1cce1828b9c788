"""``sp-diffusers sample``: render prompts with a pipeline folder (and a LoRA) under Ulysses SP, as PNG or MP4/GIF.

The pipeline's own ``__call__`` runs on every rank with the same seed; its transformer(s) run under the
``ulysses_sdpa`` backend with ``enable_parallelism`` (each rank attends over all tokens for 1/P of the heads), so the
result is the single-process one. Rank 0 writes the file: images as a PNG (several prompts tiled), videos as an MP4
(``pip install imageio imageio-ffmpeg``), else a GIF beside the requested path.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError

__all__ = ["render"]

_VIDEO_SUFFIXES = (".mp4", ".gif")


_CONDITIONED = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "FluxKontextPipeline", "WanImageToVideoPipeline")


def _sources(name: str, images: list[str] | None) -> list[Any] | None:
    """The ``--image`` files as RGB images, for the pipelines (``name``: the class) conditioned on them (refused for
    the others)."""
    if name not in _CONDITIONED:
        if images:
            raise ConfigError(f"--image: {name} takes no source image; fix: leave --image out")
        return None
    if not images:
        raise ConfigError(f"{name} edits or animates a source image; fix: --image PATH")
    if len(images) > 1 and name != "QwenImageEditPlusPipeline":
        raise ConfigError(f"--image given {len(images)} times: {name} takes one; fix: one --image")
    from PIL import Image

    from .images import as_rgb

    out = []
    for path in images:
        if not Path(path).is_file():
            raise ConfigError(f"--image {path}: no such file; fix: the path of an image file")
        try:
            with Image.open(path) as im:
                out.append(as_rgb(im))
        except Exception as err:  # truncated, not an image, a decompression bomb: one line, not a traceback
            raise ConfigError(
                f"--image {path} cannot be decoded ({type(err).__name__}: {err}); fix: a readable image file"
            ) from err
    return out


def _pipeline_class(pipeline: Path) -> tuple[str, Any]:
    """The folder's pipeline class name (``model_index.json``) and the class diffusers has by that name."""
    import json

    import diffusers

    index = pipeline / "model_index.json"
    if not index.is_file():
        raise ConfigError(f"--pipeline {pipeline}: no model_index.json; fix: a diffusers pipeline folder")
    name = json.loads(index.read_text()).get("_class_name", "")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ConfigError(f"--pipeline {pipeline}: diffusers {diffusers.__version__} has no pipeline class {name!r}")
    return name, cls


def _guidance(
    pipeline: Path, name: str, cls: Any, guidance: float | None, true_cfg: float | None, negative: str | None
) -> tuple[dict[str, Any], float | None]:
    """The guidance keywords ``name``'s ``__call__`` reads, from ``--guidance`` / ``--true-cfg`` /
    ``--negative-prompt``, and the scale for the folder's ``guider`` where the pipeline guides through one
    (HunyuanVideo-1.5: ``--guidance`` is its ``ClassifierFreeGuidance``'s ``guidance_scale``); a flag the pipeline
    would ignore is refused. Qwen-Image(-Edit) and FLUX.1 without guidance embedding guide by ``true_cfg_scale`` with
    a negative prompt (their ``guidance_scale`` is for guidance-distilled transformers only)."""
    import inspect
    import json

    params = inspect.signature(cls.__call__).parameters
    config = pipeline / "transformer" / "config.json"
    embeds = bool(json.loads(config.read_text()).get("guidance_embeds", False)) if config.is_file() else False
    takes_true_cfg = "true_cfg_scale" in params
    kwargs: dict[str, Any] = {}
    guider_scale = None
    if guidance is not None:
        if takes_true_cfg and not embeds:
            raise ConfigError(
                f"--guidance {guidance:g}: {name}'s transformer has no guidance embedding, so its guidance_scale does "
                f"nothing; its classifier-free guidance is true_cfg_scale with a negative prompt; fix: --true-cfg "
                f"{guidance:g} (and --negative-prompt TEXT; default ' ')"
            )
        if "guidance_scale" in params:
            kwargs["guidance_scale"] = guidance
        elif (pipeline / "guider" / "guider_config.json").is_file():
            guider_scale = guidance
        else:
            raise ConfigError(f"--guidance: {name} takes no guidance_scale; fix: leave --guidance out")
    if true_cfg is not None and not takes_true_cfg:
        raise ConfigError(f"--true-cfg: {name} takes no true_cfg_scale; fix: --guidance {true_cfg:g}")
    if negative is not None and "negative_prompt" not in params:
        raise ConfigError(f"--negative-prompt: {name} takes no negative prompt; fix: leave it out")
    if takes_true_cfg:
        # without --true-cfg: 1 (the pipeline's default of 4 without a negative prompt is no guidance at all, and a
        # warning each call); with it, a negative prompt (' ' where none is given: what diffusers' examples pass)
        kwargs["true_cfg_scale"] = true_cfg if true_cfg is not None else 1.0
        if kwargs["true_cfg_scale"] > 1.0 and negative is None:
            negative = " "
    if negative is not None:
        kwargs["negative_prompt"] = negative
    return kwargs, guider_scale


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _join(ulysses: int) -> None:
    """The process group of ``--ulysses`` ranks (under torchrun), joined before the pipeline loads."""
    import torch.distributed as dist

    from ...parallel.launch import init_distributed

    init_distributed(required_by=f"sample --ulysses {ulysses}")
    world = dist.get_world_size()
    if world != ulysses:
        raise ConfigError(
            f"--ulysses {ulysses} with {world} processes: sample renders one batch over one SP group; fix: "
            f"torchrun --nproc_per_node {ulysses} ... sample --ulysses {ulysses}"
        )


def _parallelize(pipe: Any, ulysses: int) -> None:
    import sp_diffusers

    sp_diffusers.install()
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is not None:
            model.set_attention_backend("ulysses_sdpa")
            model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=ulysses))


def render(
    pipeline: str | Path,
    prompts: list[str],
    out: str | Path,
    *,
    lora: str | None = None,
    lora_2: str | None = None,
    ulysses: int = 1,
    steps: int | None = None,
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    guidance: float | None = None,
    true_cfg: float | None = None,
    negative_prompt: str | None = None,
    seed: int = 0,
    dtype: str = "fp32",
    max_sequence_length: int | None = None,
    images: list[str] | None = None,
    compile: str = "off",
) -> Path | None:
    """Render ``prompts`` with ``pipeline`` and write ``out`` on rank 0 (its path there; None elsewhere); ``images``:
    the source image(s) of an editing or image-to-video pipeline (each prompt is rendered with them, one call each,
    as those pipelines take one image batch per call); ``compile``: the transformers' blocks or whole forwards
    compiled (``sp_diffusers.engine.compiling``), as ``train.compile`` does; ``guidance`` / ``true_cfg`` /
    ``negative_prompt``: what the pipeline's ``__call__`` reads (``_guidance``). Every argument is checked before
    the pipeline loads."""
    import diffusers
    import torch.distributed as dist

    from ...engine.compiling import COMPILE_MODES, compile_model
    from ..models.pipeline_io import from_pretrained
    from .media import save_image, save_video

    out, pipeline = Path(out), Path(pipeline)
    # every argument checked before a weight is read: a mistake costs a second, not a pipeline load
    if out.suffix.lower() not in (".png", *_VIDEO_SUFFIXES):
        raise ConfigError(f"--out {out}: write .png (images) or .mp4 / .gif (videos)")
    name, cls = _pipeline_class(pipeline)
    if ulysses < 1:
        raise ConfigError(f"--ulysses {ulysses}: a degree >= 1")
    if compile not in COMPILE_MODES:
        raise ConfigError(f"--compile {compile}: one of {', '.join(COMPILE_MODES)}")
    video = name.startswith(("Wan", "HunyuanVideo", "LTX2"))
    if video != (out.suffix.lower() in _VIDEO_SUFFIXES):
        kind = "a video pipeline: write .mp4 or .gif" if video else "an image pipeline: write .png"
        raise ConfigError(f"--out {out}: {name} is {kind}")
    for file, flag in ((lora, "--lora"), (lora_2, "--lora-2")):
        if file and not Path(file).is_file():
            raise ConfigError(f"{flag} {file}: no such file (a .safetensors LoRA)")
    guidance_kwargs, guider_scale = _guidance(pipeline, name, cls, guidance, true_cfg, negative_prompt)
    sources = _sources(name, images)
    if ulysses > 1:
        _join(ulysses)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    extra: dict[str, Any] = {}
    from ...families.processors import load_qwen_vl_processor, processor_tokenizer

    if (pipeline / "processor").is_dir():  # Qwen-Image-Edit: its processor without torchvision too
        extra["processor"] = load_qwen_vl_processor(pipeline / "processor")
    tokenizer = processor_tokenizer(pipeline)  # FLUX.2 [dev]: Mistral's processor needs torchvision
    if tokenizer is not None:
        extra["tokenizer"] = None
    pipe = from_pretrained(diffusers.DiffusionPipeline, pipeline, torch_dtype=torch_dtype, **extra)
    if tokenizer is not None:
        pipe.tokenizer = tokenizer
    for file, into_2 in ((lora, False), (lora_2, True)):
        if file:
            path = Path(file)
            extra = {"load_into_transformer_2": True} if into_2 else {}
            if hasattr(pipe, "load_lora_weights"):
                pipe.load_lora_weights(str(path.parent), weight_name=path.name, **extra)
            else:  # no LoRA loader (HunyuanVideo15Pipeline): the file as export writes it (io/export.LORA_WRITERS)
                model = pipe.transformer_2 if into_2 else pipe.transformer
                model.load_lora_adapter(str(path.parent), weight_name=path.name, prefix="transformer")
    if guider_scale is not None:  # the folder's guider at --guidance (its other settings kept)
        pipe.guider = pipe.guider.new(guidance_scale=guider_scale)
    pipe.to(_device())
    pipe.set_progress_bar_config(disable=True)
    for part in ("transformer", "transformer_2"):  # before the plan's hooks wrap the forwards
        if getattr(pipe, part, None) is not None:
            compile_model(getattr(pipe, part), compile)
    if ulysses > 1:
        _parallelize(pipe, ulysses)
    kwargs: dict[str, Any] = {"prompt": list(prompts), "output_type": "pt", **guidance_kwargs}
    takes = inspect.signature(cls.__call__).parameters
    for key, value in (
        ("num_inference_steps", steps),
        ("height", height),
        ("width", width),
        ("max_sequence_length", max_sequence_length),
    ):
        # HunyuanVideo15Pipeline takes no max_sequence_length (its text lengths are fixed): not passed there
        if value is not None and (key != "max_sequence_length" or key in takes):
            kwargs[key] = value
    if video and frames is not None:
        kwargs["num_frames"] = frames
    if name == "LTX2Pipeline":
        # the trainer's sampler: plain CFG at one scale for video and audio, no STG, modality guidance or rescale
        scale = kwargs.get("guidance_scale", _call_default(cls, "guidance_scale"))
        kwargs.update(audio_guidance_scale=scale, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0)
        kwargs.update(audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    # one prompt a call: the conditioned pipelines take one image batch per call; diffusers' (0.42)
    # AutoencoderKLHunyuanVideo15 decodes one video at a time (its mid-block attention mask breaks for a batch)
    if sources is None and name != "HunyuanVideo15Pipeline":
        result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed))
        pixels = (result.frames if video else result.images).float().cpu()
        audio = result.audio if name == "LTX2Pipeline" else None  # LTX-2: the soundtrack [B, channels, samples]
    else:
        if name == "FluxKontextPipeline" and height and width:
            kwargs["max_area"] = height * width  # Kontext scales the output to max_area (1 MP) otherwise
        parts = []
        for prompt in prompts:
            kwargs["prompt"] = [prompt]
            if sources is not None:
                kwargs["image"] = sources if len(sources) > 1 else sources[0]
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed))
            parts.append((result.frames if video else result.images).float().cpu())
        pixels, audio = torch.cat(parts), None
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    if audio is not None:  # muxed into a single video's MP4, and a WAV beside it (media.save_video)
        rate = int(pipe.vocoder.config.output_sampling_rate)
        fps = float(_call_default(cls, "frame_rate"))
        return save_video(pixels, out, fps=fps, audio=audio.float().cpu(), sample_rate=rate)
    return save_video(pixels, out) if video else save_image(pixels, out)


def _call_default(cls: Any, name: str) -> Any:
    """``cls.__call__``'s default for ``name``."""
    return inspect.signature(cls.__call__).parameters[name].default
