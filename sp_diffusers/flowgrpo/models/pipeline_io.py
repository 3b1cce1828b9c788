"""A diffusers pipeline folder in (``model.pipeline``): which family it is, its transformer(s), VAE and scheduler.

A folder written by ``save_pretrained`` (or a downloaded model repository) holds ``model_index.json`` naming the
pipeline class and one subfolder per component. The trainer reads from it: the transformer (Wan2.2-A14B: both
``transformer`` and ``transformer_2``), loaded in the dtype the engine trains in; the text encoder(s) and
tokenizer(s) (``text.PipelineTextEncoder``, unless ``text.pipeline`` names another folder); the scheduler config
(the rollout schedule, unless ``flowgrpo.scheduler`` names another); the VAE (decoding pixels for rewards and sample
grids); and, for Wan2.2, ``boundary_ratio`` from the pipeline's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, TrainConfig
from .folder_checks import PIPELINE_FAMILIES, check_model_folder, condition_of, present, read_index

__all__ = [
    "EXPERT_NAMES",
    "PIPELINE_FAMILIES",
    "boundary_ratio",
    "condition_kind",
    "expert_names",
    "from_pretrained",
    "load_audio_decoders",
    "load_component",
    "load_transformers",
    "load_vae",
    "meta_transformers",
    "param_dtype",
    "read_index",
    "resolve_pipeline",
    "transformer_folder",
]

EXPERT_NAMES = ("transformer", "transformer_2")  # WanPipeline: high-noise, low-noise

def resolve_pipeline(config: TrainConfig) -> str:
    """Settle ``model.kind``: from ``model.pipeline`` or ``model.pretrained`` (which must agree with a given one),
    else the tiny default; with ``model.pipeline``, also check that the folder holds every component this run loads
    (``folder_checks.check_model_folder``: JSON only, no weights). Returns the family."""
    check_model_folder(config)
    return config.model.kind


def expert_names(config: TrainConfig) -> tuple[str, ...]:
    """The transformers of ``model.pipeline``: ``("transformer",)``, or both of a two-expert Wan2.2."""
    if not config.model.pipeline:
        return ("transformer",)
    index = read_index(config.model.pipeline)
    return tuple(n for n in EXPERT_NAMES if present(index, n))


def condition_kind(config: TrainConfig) -> str:
    """How ``model.pipeline``'s condition images reach its transformer (``folder_checks.PIPELINE_CONDITIONS``): ``""``
    for text-to-image and text-to-video."""
    return condition_of(read_index(config.model.pipeline)) if config.model.pipeline else ""


def boundary_ratio(config: TrainConfig) -> float | None:
    """Wan2.2's ``boundary_ratio`` (the pipeline config): ``transformer`` runs at timesteps >= ratio x 1000."""
    if not config.model.pipeline:
        return None
    value = read_index(config.model.pipeline).get("boundary_ratio")
    return float(value) if value is not None else None


def param_dtype(config: TrainConfig) -> torch.dtype:
    """The dtype the engine keeps parameters in: fp32, except bf16 without FSDP (FSDP's bf16 mixed precision keeps
    fp32 parameters and computes in bf16)."""
    p = config.parallel
    return torch.bfloat16 if p.mixed_precision == "bf16" and not p.use_fsdp else torch.float32


def compute_dtype(config: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if config.parallel.mixed_precision == "bf16" else torch.float32


def from_pretrained(cls: Any, path: str | Path, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` with ``torch_dtype``, which every supported diffusers takes (newer ones prefer
    ``dtype`` and warn about the old name: the warning is not the user's to act on)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
        return cls.from_pretrained(path, **kwargs)


def transformer_folder(config: TrainConfig, name: str = "transformer") -> Path | None:
    """Where transformer ``name``'s weights lie: the pipeline's subfolder, or ``model.pretrained`` (None: neither)."""
    if config.model.pipeline:
        return Path(config.model.pipeline) / name
    return Path(config.model.pretrained) if config.model.pretrained else None


def meta_transformers(config: TrainConfig, names: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """``{name: transformer}`` built from each folder's config with its parameters on ``meta``: nothing is read or
    allocated here; the engine shards each one and then loads only its own rows, converted to the parameters'
    dtype shard by shard (``engine_settings`` points ``weights`` at :func:`transformer_folder`)."""
    from ...engine.weights import meta_model
    from ...families.kinds import model_class

    cls = model_class(config.model.kind)
    return {n: meta_model(cls, transformer_folder(config, n)) for n in names}


def load_transformers(config: TrainConfig, names: tuple[str, ...] | None = None) -> dict[str, torch.nn.Module]:
    """``{name: transformer}`` of ``model.pipeline`` (``names``: default all), each in the training dtype, on CPU."""
    from ...families.kinds import model_class

    cls = model_class(config.model.kind)
    dtype = param_dtype(config)
    return {
        name: from_pretrained(cls, config.model.pipeline, subfolder=name, torch_dtype=dtype)
        for name in (names or expert_names(config))
    }


def load_vae(config: TrainConfig) -> torch.nn.Module | None:
    """The pipeline's VAE in the compute dtype (None without ``model.pipeline`` or without a VAE in it)."""
    return load_component(config, "vae")


def load_audio_decoders(config: TrainConfig) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """LTX-2's ``(audio_vae, vocoder)`` in the compute dtype (None where the pipeline has no audio)."""
    parts = load_component(config, "audio_vae"), load_component(config, "vocoder")
    return None if parts[0] is None or parts[1] is None else parts


def load_component(config: TrainConfig, name: str) -> torch.nn.Module | None:
    """``model.pipeline``'s component ``name`` in the compute dtype (None without the folder or the component). Its
    class is a diffusers model, or one a pipeline module defines (LTX-2's ``LTX2Vocoder``: ``pipelines.ltx2``)."""
    if not config.model.pipeline:
        return None
    index = read_index(config.model.pipeline)
    if not present(index, name):
        return None
    import importlib

    import diffusers

    library, cls_name = index[name]
    cls = getattr(diffusers, cls_name, None)
    if cls is None and library not in ("diffusers", "transformers"):
        cls = getattr(importlib.import_module(f"diffusers.pipelines.{library}"), cls_name, None)
    if cls is None:
        raise ConfigError(f"model.pipeline: its {name} is a {library}.{cls_name}, which this diffusers does not have")
    return from_pretrained(cls, config.model.pipeline, subfolder=name, torch_dtype=compute_dtype(config))
