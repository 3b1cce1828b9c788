"""Trained weights out, in diffusers' own formats: ``sp-diffusers export --run RUN_DIR --out DIR``.

From the newest checkpoint of a run (or ``step``), written on any layout (DCP reads any sharding into one process):

- ``DIR/transformer/`` (Wan2.2: also ``DIR/transformer_2/``): ``save_pretrained`` of the trained transformer with its
  LoRA merged (``W + alpha / r * B A``), which the family's ``from_pretrained`` loads;
- LoRA runs: ``DIR/pytorch_lora_weights.safetensors`` in diffusers' LoRA format (``transformer.``-prefixed peft keys
  and the adapter's config as metadata, so alpha survives), which the pipeline's ``load_lora_weights`` and the
  transformer's ``load_lora_adapter`` read; a Wan2.2 ``transformer_2``'s is ``pytorch_lora_weights_transformer_2
  .safetensors`` (``load_lora_weights(DIR, weight_name=..., load_into_transformer_2=True)``);
- with ``model.pipeline``: the rest of that pipeline folder beside them (copy-on-write clones where the file system
  offers them, else copies; hard links only with ``link``, made read-only; an expert that was not trained as it
  was), so ``DiffusionPipeline.from_pretrained(DIR)`` loads the trained pipeline;
- ``DIR/sp_diffusers_export.json``: which run and step it came from (what marks the folder as an export).

The folder is written beside ``DIR`` and renamed into place at the end (``export_folder.py``): an export at ``DIR``
is replaced only with ``force``, and only whole; a folder that is not an export is never written into.

Only the model part of the checkpoint is read (no optimizer state), into a model built as the run built it; where
the run kept a moving average of its weights (``flowgrpo.ema``), that average is what is exported, as flow_grpo
saves its EMA weights.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...engine.checkpoint_files import (
    CheckpointError,
    find_latest,
    lora_fingerprint,
    model_fingerprint,
    read_meta,
)
from ..config import ConfigError, TrainConfig, load_config
from .export_folder import MARKER, copy_file, copy_tree, prepare_target, publish, staging_folder

__all__ = ["Exported", "export_run", "lora_state_dict", "merged_state_dict"]

PIPELINE_CLASSES = {
    "qwenimage": "QwenImagePipeline",
    "flux": "FluxPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "wan": "WanPipeline",
    "zimage": "ZImagePipeline",
    "flux2": "Flux2KleinPipeline",  # its LoRA file (Flux2LoraLoaderMixin, which Flux2Pipeline shares)
    "hunyuanvideo15": "HunyuanVideo15Pipeline",
    "ltx2": "LTX2Pipeline",
}
# kinds whose pipeline has no LoRA loader in diffusers (0.42: HunyuanVideo15Pipeline): the LoRA file is written in the
# same format (``transformer.``-prefixed keys, the adapter's metadata) by this mixin; load it with
# ``pipe.transformer.load_lora_adapter(folder, weight_name=..., prefix="transformer")``
LORA_WRITERS = {"hunyuanvideo15": "HunyuanVideoLoraLoaderMixin"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Exported:
    transformers: dict[str, Path] = field(default_factory=dict)  # name -> save_pretrained folder
    loras: dict[str, Path] = field(default_factory=dict)  # name -> LoRA safetensors
    pipeline: Path | None = None  # the whole pipeline folder (model.pipeline runs)
    pipeline_class: str = ""  # its class (model_index.json)
    step: str = ""
    files: Counter = field(default_factory=Counter)  # the source pipeline's files by how: clone, copy, link
    replaced: bool = False  # an export was at the target and was replaced (--force)
    notes: list[str] = field(default_factory=list)  # what was cleaned up or restored before writing


def run_config(run_dir: str | Path) -> TrainConfig:
    """The config a run was trained with (``<run>/config.json``)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no config.json; fix: the train.out_dir of a `sp-diffusers train` run")
    return load_config(path)


def _step_dir(root: Path, step: int | None) -> Path:
    if step is None:
        found = find_latest(root)
        if found is None:
            raise CheckpointError(f"no checkpoint under {root}; fix: train until a checkpoint is saved (train.save_every)")
        return found
    path = root / f"step-{step:08d}"
    if not (path / "meta.json").is_file():
        have = sorted(p.name for p in root.glob("step-*"))
        raise CheckpointError(f"--step {step}: no complete checkpoint {path}; have: {', '.join(have) or 'none'}")
    return path


def _fresh_model(config: TrainConfig, name: str) -> torch.nn.Module:
    """The untrained transformer ``name``, real and whole (export writes whole files from one process)."""
    from ...families.kinds import model_class
    from ...tiny import tiny_model
    from ..models.pipeline_io import from_pretrained, load_transformers, param_dtype

    if config.model.pipeline:
        return load_transformers(config, (name,))[name]
    if config.model.pretrained:
        return from_pretrained(model_class(config.model.kind), config.model.pretrained, torch_dtype=param_dtype(config))
    return tiny_model(config.model.kind, seed=config.model.seed, **config.model.overrides)


def _load_trained(config: TrainConfig, name: str, path: Path) -> torch.nn.Module:
    """The model as the run trained it (LoRA added as the engine adds it), its weights from checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ...engine.model_setup import add_lora
    from ..build import engine_settings
    from ..models.pipeline_io import param_dtype

    model = _fresh_model(config, name)
    if next(model.parameters()).dtype != param_dtype(config):  # as the engine held it: the dtype stored
        model = model.to(param_dtype(config))
    lora = engine_settings(config).lora
    if lora is not None:
        add_lora(model, lora)
    meta = read_meta(path)
    same_lora = meta.lora == (lora is not None) and meta.lora_fingerprint in ("", lora_fingerprint(lora))
    if meta.model_fingerprint != model_fingerprint(model) or not same_lora:
        raise CheckpointError(
            f"checkpoint {path} was written for another model or LoRA than {path.parent.parent.parent}/config.json "
            "describes; fix: export the run folder the checkpoint belongs to"
        )
    state = {"model": get_model_state_dict(model)}
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if any(k.startswith("ema.") for k in stored):  # flowgrpo.ema: the moving average is what the run evaluated
        state["ema"] = {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}
    dcp.load(state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    set_model_state_dict(model, state["model"])
    if "ema" in state:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in state["ema"]:
                    p.copy_(state["ema"][n])
    return model


def merged_state_dict(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The base model's state dict with each LoRA layer folded in: ``W + scaling * B @ A`` (peft's own merge)."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    lora_prefixes = set()
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            base = module.get_base_layer()
            if not isinstance(base, torch.nn.Linear):
                raise ValueError(f"export merges LoRA into Linear layers; {module_name} is a {type(base).__name__}")
            delta = module.get_delta_weight(adapter).detach().float()
            out[f"{module_name}.weight"] = (base.weight.detach().float() + delta).contiguous()
            if base.bias is not None:
                out[f"{module_name}.bias"] = base.bias.detach().clone()
            lora_prefixes.add(module_name + ".")
    for key, value in model.state_dict().items():
        if not any(key.startswith(p) for p in lora_prefixes):
            out[key] = value.detach()
    return out


def lora_state_dict(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's saved form (``...lora_A.weight`` / ``...lora_B.weight``, no adapter name)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=adapter).items()}


def _save_transformer(trained: torch.nn.Module, merged: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype) -> None:
    with torch.device("meta"):
        fresh = type(trained).from_config(dict(trained.config))
    fresh.load_state_dict({k: v.to(dtype) for k, v in merged.items()}, strict=True, assign=True)
    fresh.save_pretrained(folder)


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    dtype: str = "fp32",
    force: bool = False,
    link: bool = False,
    link_as_root: bool = False,
) -> Exported:
    """Write the run's trained weights to ``out_dir`` in diffusers' formats (module docstring): staged beside it and
    renamed into place; an export already there is replaced only with ``force``; ``link`` hard-links the source
    pipeline's files (read-only) instead of cloning or copying them (as root only with ``link_as_root``)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(_DTYPES)}")
    run_dir, out = Path(run_dir), Path(out_dir).absolute()
    config = run_config(run_dir)
    _check_out(out, config, force, link, link_as_root)
    replace, notes = prepare_target(out, force)  # before anything is loaded: a refusal costs nothing
    stage = staging_folder(out)
    try:
        result = _write(config, run_dir, stage, step, dtype, link)
        marker = {"run": str(run_dir.absolute()), "step": result.step, "pipeline": result.pipeline_class}
        (stage / MARKER).write_text(json.dumps({**marker, "files": "link" if link else "copy"}, indent=2))
        publish(stage, out, replace)
    except BaseException:
        import shutil

        shutil.rmtree(stage, ignore_errors=True)  # the previous export (if any) is untouched
        raise
    result.transformers = {n: out / p.name for n, p in result.transformers.items()}
    result.loras = {n: out / p.name for n, p in result.loras.items()}
    result.pipeline = out if result.pipeline is not None else None
    result.replaced, result.notes = replace, notes
    copied = result.files.get("copy", 0) + result.files.get("clone", 0)
    if link and copied:
        notes.append(
            f"--link: {copied} of the source pipeline's files are on another file system than --out (a hard link "
            "cannot cross one): they were copied instead"
        )
    return result


def _check_out(out: Path, config: TrainConfig, force: bool, link: bool, link_as_root: bool) -> None:
    """Refuse an export that would pull a folder from under its user, or share writable inodes with root."""
    if force:
        here = Path.cwd().resolve()
        target = out.resolve()
        if here == target or target in here.parents:
            raise ConfigError(
                f"--out {out} is the current directory (or holds it): replacing it would leave this shell in a "
                "deleted folder; fix: cd out of it first (e.g. cd ..), then export again"
            )
        for key in ("model.pipeline", "model.pretrained", "text.pipeline"):
            section, name = key.split(".")
            source = getattr(getattr(config, section), name)
            if source and target in (Path(source).resolve(), *Path(source).resolve().parents):
                raise ConfigError(
                    f"--out {out} is the folder the run trains from ({key}={source}): replacing it would change what "
                    "the run and a resume of it load; fix: --out another folder"
                )
    if link and not link_as_root and hasattr(os, "geteuid") and os.geteuid() == 0:
        raise ConfigError(
            "--link as root: the linked files are read-only, but root writes through that, and a write into the "
            "export (a save_pretrained, an editor) would change the source pipeline's file, which is the same file; "
            "fix: export without --link (copy-on-write clones where the file system offers them), or --link "
            "--link-as-root where nothing will write into the export"
        )


def _write(config: TrainConfig, run_dir: Path, out: Path, step: int | None, dtype: str, link: bool) -> Exported:
    """Everything of the export into the (staging) folder ``out``."""
    import diffusers

    from ..models.pipeline_io import expert_names, read_index

    names = expert_names(config)
    trained = list(config.model.experts) or list(names)
    roots = {n: run_dir / "checkpoints" / n for n in trained} if len(names) > 1 else {names[0]: run_dir / "checkpoints"}
    result = Exported()
    steps = {n: _step_dir(root, step) for n, root in roots.items()}
    result.step = next(iter(steps.values())).name
    if len({p.name for p in steps.values()}) > 1:
        raise CheckpointError(f"the experts' checkpoints are at different steps ({steps}); fix: --step N")
    pipeline_cls = getattr(diffusers, PIPELINE_CLASSES.get(config.model.kind, ""), None)
    if config.model.kind in LORA_WRITERS:
        from diffusers.loaders import lora_pipeline

        pipeline_cls = getattr(lora_pipeline, LORA_WRITERS[config.model.kind])
    for name, path in steps.items():
        model = _load_trained(config, name, path)
        folder = out / name
        _save_transformer(model, merged_state_dict(model) if config.lora.enabled else model.state_dict(), folder, _DTYPES[dtype])
        result.transformers[name] = folder
        if config.lora.enabled:
            if pipeline_cls is None:
                raise ConfigError(f"model.kind={config.model.kind!r} has no pipeline class to write its LoRA file with")
            weight = "pytorch_lora_weights.safetensors" if name == "transformer" else f"pytorch_lora_weights_{name}.safetensors"
            pipeline_cls.save_lora_weights(
                out,
                transformer_lora_layers=lora_state_dict(model),
                weight_name=weight,
                transformer_lora_adapter_metadata=model.peft_config["default"].to_dict(),
            )
            result.loras[name] = out / weight
        del model
    if config.model.pipeline:
        source = Path(config.model.pipeline)
        result.pipeline_class = read_index(source).get("_class_name", "")
        for entry in sorted(source.iterdir()):
            if entry.name in result.transformers or entry.name.startswith(".") or entry.name == MARKER:
                continue
            if entry.is_dir():
                result.files += copy_tree(entry, out / entry.name, link)
            elif not (out / entry.name).exists():  # a LoRA file just written keeps its place
                result.files[copy_file(entry, out / entry.name, link)] += 1
        result.pipeline = out
    return result
