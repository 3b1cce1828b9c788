"""Weight export for the rollout's weight sync: full (unsharded) tensors, LoRA-aware, as verl names them."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from ...engine import FSDPEngine

__all__ = ["per_tensor_params"]


def per_tensor_params(
    engine: FSDPEngine, merge: bool = False, base_sync_done: bool = False
) -> tuple[Generator[tuple[str, torch.Tensor], None, None], dict | None]:
    """Full tensors (generator) and the peft config (None without LoRA, or when merged).

    Every rank must consume the generator in step: each tensor is all-gathered from its FSDP shards.
    Without LoRA: every tensor of the state dict. With LoRA (verl's convention): ``merge=True`` sends the
    merged weights ``W + (alpha / r) B A`` under the base names (no peft config); otherwise
    ``base_sync_done=False`` sends the base weights (``.base_layer`` dropped from names, adapters left out)
    and ``base_sync_done=True`` only the adapter weights (peft names, e.g. ``...to_q.lora_A.weight``), each
    with the peft config.
    """
    model = engine.model
    if engine.lora is None:
        return _full_tensors(model.state_dict().items()), None
    adapter = engine.lora.adapter_name
    peft_config = model.peft_config[adapter].to_dict()
    if merge:
        return _merged_lora(model, adapter), None
    state = model.state_dict()
    if base_sync_done:
        marker = f".{adapter}."
        items = ((k.replace(marker, "."), v) for k, v in state.items() if "lora_" in k and marker in k)
    else:
        items = ((k.replace(".base_layer", ""), v) for k, v in state.items() if "lora_" not in k)
    return _full_tensors(items), peft_config


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _full_tensors(items: Any) -> Generator[tuple[str, torch.Tensor], None, None]:
    for name, value in items:
        yield name, _full(value)


def _merged_lora(model: torch.nn.Module, adapter: str) -> Generator[tuple[str, torch.Tensor], None, None]:
    layers = {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {})
    }
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        owner = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        tensor = _full(value)
        if owner in layers and key.endswith(".base_layer.weight"):
            layer = layers[owner]
            a = _full(layer.lora_A[adapter].weight).float()
            b = _full(layer.lora_B[adapter].weight).float()
            tensor = (tensor.float() + layer.scaling[adapter] * (b @ a)).to(tensor.dtype)
        yield key.replace(".base_layer", ""), tensor
