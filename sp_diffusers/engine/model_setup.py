"""What ``FSDPEngine`` does to a model and a process group before sharding: the plan check, LoRA adapters, the
host-side control groups."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import host_subgroups, needs_host_groups
from ..parallel.mesh import ParallelDims
from .settings import LoraSettings
from .weights import WeightsError, materialize

__all__ = ["add_lora", "check_cp_plan", "control_groups", "materialize_everywhere"]


def check_cp_plan(model: torch.nn.Module) -> None:
    if getattr(model, "_cp_plan", None) is None:
        raise ValueError(
            f"{type(model).__name__} has no context-parallel plan (_cp_plan), so its sequence cannot be "
            "sharded; fix: use a model with a plan (Qwen-Image, Flux, Wan, LTX, ...) or set model._cp_plan"
        )


def add_lora(model: torch.nn.Module, lora: LoraSettings) -> None:
    """peft adapters on ``lora.target_modules``; everything else frozen."""
    try:
        from peft import LoraConfig
    except ImportError as err:  # pragma: no cover - peft is in the [train] extra
        raise ImportError("LoRA needs peft: pip install 'sp-diffusers[train]'") from err
    model.requires_grad_(False)
    with lora.seeded():
        model.add_adapter(
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                target_modules=list(lora.target_modules),
                init_lora_weights=lora.init,
            ),
            adapter_name=lora.adapter_name,
        )


def control_groups(dims: ParallelDims, sp_group: Any) -> tuple[Any, Any]:
    """The groups of the engine's small host-side agreements (the world, this rank's SP group): the world and
    the SP group themselves where they carry CPU tensors (gloo), else gloo twins over the same ranks, so that
    an agreement never waits for the GPU (on NCCL each would cost a device round trip and a host sync).
    Collective: every rank calls it."""
    if not needs_host_groups():
        return dist.group.WORLD, sp_group
    world = host_subgroups([range(dims.world)])
    sp_blocks = [range(d * dims.sp, (d + 1) * dims.sp) for d in range(dims.dp)]  # the mesh's SP groups
    return world, host_subgroups(sp_blocks) if dims.sp > 1 else None


def materialize_everywhere(
    model: torch.nn.Module, device: torch.device, source: Any, lora: LoraSettings | None, group: Any
) -> None:
    """``weights.materialize`` on every rank; a failure on any rank (a file one rank cannot read) raises on
    all of them, so that no rank is left waiting in the next collective."""
    error: Exception | None = None
    try:
        materialize(model, device, source, lora)
    except Exception as err:  # shared below, then raised everywhere
        error = err
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        texts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(texts, f"{type(error).__name__}: {error}" if error else None, group=group)
        failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
        if failed and error is None:
            rank, text = failed[0]
            raise WeightsError(f"loading EngineSettings.weights failed on rank {rank}: {text}")
    if error is not None:
        raise error
