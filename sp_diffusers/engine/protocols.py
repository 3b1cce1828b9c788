"""What the engine's helpers need of an engine, as Protocols: ``batch``, ``checkpoint`` and ``step_agreement``
work on any object with these attributes (``FSDPEngine`` is one), so none of them imports the engine that
imports them. Also the engine's layout record, which those helpers read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["BatchOwner", "EngineLayout", "StepRunner", "TrainState"]


@dataclass
class EngineLayout:
    """Where this process sits: world size, the dp / ring / ulysses degrees, its global, dp and SP ranks, and the
    HSDP replica groups the dp ranks split into (1: plain FSDP)."""

    world: int
    dp: int
    ring: int
    ulysses: int
    rank: int
    dp_rank: int = 0
    sp_rank: int = 0
    replicate: int = 1


class BatchOwner(Protocol):
    """What ``engine.batch`` reads: the SP group, its first rank, the device and the debug switch."""

    sp_size: int
    sp_group: dist.ProcessGroup | None
    sp_control_group: dist.ProcessGroup | None
    device: torch.device
    settings: Any

    @property
    def debug_checks(self) -> bool: ...

    @property
    def sp_src_global_rank(self) -> int: ...

    def verify_sp_consistency(self, tensors: dict[str, Any], what: str = "batch") -> None: ...


class TrainState(Protocol):
    """What ``engine.checkpoint`` saves and restores: model, optimizer, schedule, step, layout, LoRA."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    control_group: dist.ProcessGroup | None
    layout: EngineLayout
    global_step: int

    @property
    def lora(self) -> Any: ...

    def zero_grad(self) -> None: ...


class StepRunner(Protocol):
    """What ``engine.step_agreement`` needs: the layout, the control group and the forward it runs."""

    layout: EngineLayout
    control_group: dist.ProcessGroup | None

    def forward(self, **inputs: Any) -> torch.Tensor: ...
