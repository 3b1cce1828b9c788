"""Giving a model built on ``meta`` its values after FSDP2 sharded it: no rank ever holds the whole model.

A 20B transformer is 80 GB in fp32: loading it on every rank and then sharding needs that much on each GPU
(and host) before the first shard exists. Built with its parameters on ``meta`` instead (:func:`meta_model`),
the model is sharded first (``fully_shard`` keeps meta parameters meta), then each rank allocates only its own
shards on its device (``to_empty``) and fills them from a source (:func:`materialize`):

- a folder or ``.safetensors`` file(s) of diffusers' format (a ``save_pretrained`` folder, a pipeline folder
  with ``transformer/``, or a file): each rank reads only the rows of its own shards (safetensors slices),
  converted to the parameter's dtype one shard at a time;
- a state dict of full tensors (e.g. rank 0's ``model.state_dict()``): each rank copies its rows;
- a callable ``init(model)``: any initialisation of the materialised model (e.g. ``reset_parameters``);
- ``"empty"``: left uninitialised (a planner tracing memory under ``FakeTensorMode``, or a checkpoint load
  that follows).

Buffers are not sharded: build the model so they stay real (``meta_model`` / ``accelerate.init_empty_weights``
put only parameters on meta; non-persistent buffers such as RoPE tables keep the values their ``__init__``
computed). LoRA adapters a source does not hold get peft's own initialisation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .settings import LoraSettings

__all__ = ["WeightsError", "materialize", "meta_model", "on_meta"]

WEIGHTS_NAMES = ("diffusion_pytorch_model", "model")


class WeightsError(ValueError):
    """A meta model without a usable source of values; the message names the setting and the fix."""


def meta_model(
    model_class: type, config: dict[str, Any] | str | os.PathLike, **kwargs: Any
) -> torch.nn.Module:
    """``model_class`` from ``config`` (a dict, or a folder holding ``config.json``) with its parameters on
    ``meta`` and its buffers real: no parameter memory is allocated anywhere."""
    from accelerate import init_empty_weights

    if not isinstance(config, dict):
        config = model_class.load_config(str(config), **kwargs)
    with init_empty_weights(include_buffers=False):
        return model_class.from_config(config)


def on_meta(model: torch.nn.Module) -> bool:
    """True when any of the model's parameters is on ``meta`` (the engine then needs ``weights``)."""
    return any(p.is_meta for p in model.parameters())


def materialize(
    model: torch.nn.Module, device: torch.device, source: Any, lora: LoraSettings | None = None
) -> None:
    """Allocate the meta parameters of (sharded) ``model`` on ``device`` and fill them from ``source`` (see the
    module docstring). Tensors that are already real (buffers, adapters peft made on the host) keep their
    values; a meta one needs a source that holds it (or is a LoRA adapter: peft initialises it)."""
    if source is None:
        raise WeightsError(
            "the model's parameters are on meta and EngineSettings.weights is None; fix: pass weights= a "
            "save_pretrained folder or .safetensors file, a state dict, a callable init(model), or 'empty'"
        )
    if not (isinstance(source, (str, os.PathLike, dict)) or callable(source)):
        raise WeightsError(
            f"EngineSettings.weights={type(source).__name__} is not a path, a state dict, a callable or 'empty'"
        )
    # references, not copies: to_empty replaces the module's tensors, these keep the old storage alive
    # (non-persistent buffers too: a RoPE table is in no state dict and no checkpoint)
    keep = {name: t for name, t in _tensors(model).items() if not t.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        tensors = _tensors(model)
        for name, value in keep.items():
            tensors[name].copy_(value)
        if isinstance(source, str) and source == "empty":
            return
        if callable(source):
            source(model)
            return
        state = {name: tensors[name] for name in model.state_dict(keep_vars=True) if name in tensors}
        missing = _load_values(state, source, set(keep))
        _init_lora(model, missing, lora)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _load_values(state: dict[str, torch.Tensor], source: Any, skip: set[str]) -> list[str]:
    """Copy every state-dict entry the source holds into this rank's part of it; the keys it lacks."""
    reader = _Reader(source)
    missing = []
    for name, target in state.items():
        if name in skip:
            continue
        key = reader.key_for(name)
        if key is None:
            missing.append(name)
            continue
        local, rows = _local_part(target)
        value = reader.rows(key, rows, tuple(target.shape))
        local.copy_(value.to(dtype=local.dtype).reshape(local.shape), non_blocking=local.device.type != "cpu")
    return missing


def _local_part(target: torch.Tensor) -> tuple[torch.Tensor, slice | None]:
    """This rank's tensor and which rows of the full tensor it holds (None: all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return target, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(target.shape[1:]):
        raise WeightsError(f"only row (dim 0) shards load from a source, got placements {target.placements}")
    return target.to_local(), slice(offset[0], offset[0] + shape[0])


def _init_lora(model: torch.nn.Module, missing: list[str], lora: LoraSettings | None) -> None:
    """peft's own initialisation for the adapters a source lacks; any other missing key is an error."""
    others = [n for n in missing if lora is None or "lora_" not in n]
    if others:
        raise WeightsError(
            f"EngineSettings.weights lacks {len(others)} of the model's tensors (first: {others[:3]}); fix: point "
            "it at the weights of this model class and config (the transformer folder of its pipeline)"
        )
    if not missing or lora is None:
        return
    name = lora.adapter_name
    with lora.seeded():
        for module in model.modules():
            if name in getattr(module, "lora_A", {}) and hasattr(module, "reset_lora_parameters"):
                if lora.init is False:
                    # peft's init_lora_weights=False keeps the layers' own nn.Linear initialisation, which to_empty
                    # erased (peft's reset returns without touching them): redo it
                    module.lora_A[name].reset_parameters()
                    module.lora_B[name].reset_parameters()
                else:
                    module.reset_lora_parameters(name, lora.init)


class _Reader:
    """Rows of named tensors from a state dict or from safetensors files (memory-mapped: only the rows a rank
    asks for are read)."""

    def __init__(self, source: Any) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None
        self.files: dict[str, Path] = {}
        if isinstance(source, dict):
            self.tensors = source
        elif isinstance(source, (str, os.PathLike)):
            for path in _safetensors_files(Path(source)):
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), path))
        self._open: dict[Path, Any] = {}

    def key_for(self, name: str) -> str | None:
        """The source's key for a model key (peft's ``.base_layer`` is not in a base checkpoint)."""
        held = self.tensors if self.tensors is not None else self.files
        for key in (name, name.replace(".base_layer", "")):
            if key in held:
                return key
        return None

    def rows(self, key: str, rows: slice | None, shape: tuple[int, ...]) -> torch.Tensor:
        if self.tensors is not None:
            value = self.tensors[key]
            stored = tuple(value.shape)
        else:
            value = self._handle(self.files[key]).get_slice(key)
            stored = tuple(value.get_shape())
        if stored != shape:
            raise WeightsError(
                f"EngineSettings.weights holds {key} with shape {stored}, the model has {shape}; fix: the weights "
                "of this model's config"
            )
        if rows is None:
            return value if self.tensors is not None else self._handle(self.files[key]).get_tensor(key)
        return value[rows.start : rows.stop]  # a safetensors slice reads only these rows

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a file, a ``save_pretrained`` folder (sharded or not) or a pipeline folder."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsError(f"EngineSettings.weights={str(path)!r} is not a .safetensors file")
        return [path]
    for folder in (path, path / "transformer"):
        for stem in WEIGHTS_NAMES:
            index = folder / f"{stem}.safetensors.index.json"
            if index.is_file():
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                return [folder / n for n in names]
            single = folder / f"{stem}.safetensors"
            if single.is_file():
                return [single]
    raise WeightsError(
        f"EngineSettings.weights={str(path)!r} holds no safetensors weights (diffusion_pytorch_model.safetensors "
        "or its .index.json, here or under transformer/); fix: save the model with save_pretrained "
        "(safe_serialization=True) or pass the folder that holds them"
    )
