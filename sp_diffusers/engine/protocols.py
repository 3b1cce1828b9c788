"""What is asked of an engine, as Protocols: ``TrainingEngine``, the interface the trainer runs on (``FSDPEngine``
and Wan2.2's two experts, ``flowgrpo.models.experts.ExpertEngines``, both answer it: no attribute is probed);
and what the engine's own helpers (``batch``, ``checkpoint``, ``step_agreement``) need of it, so that none of them
imports the engine that imports them. Also the engine's layout record, which those helpers read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["BatchOwner", "EngineLayout", "StepRunner", "TrainState", "TrainingEngine"]


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


class TrainingEngine(Protocol):
    """The engine of an RL run: its layout and device, the forward of schedule step ``i`` (``for_step``: one model,
    or the expert of that step), where the weights live (held gathered for a rollout, resharded after), batches made
    identical in the SP group, a training step's pieces and its checkpoints."""

    model: torch.nn.Module
    device: torch.device
    layout: EngineLayout
    control_group: dist.ProcessGroup | None
    global_step: int

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def sp_size(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def debug_checks(self) -> bool: ...

    def for_step(self, step: int) -> Any: ...

    def forward(self, **inputs: Any) -> torch.Tensor: ...

    def eval_mode(self) -> Any: ...

    def adapters_disabled(self) -> Any: ...

    def gathered_params(self, backward: bool = False) -> Any: ...

    def release_params(self) -> None: ...

    def gather_fits(self) -> bool: ...

    def prepare_batch(self, batch: dict[str, Any]) -> dict[str, Any]: ...

    def gather_dp(self, t: torch.Tensor) -> torch.Tensor: ...

    def verify_sp_consistency(self, tensors: dict[str, Any], what: str = "batch") -> None: ...

    def forward_backward(self, batch: Any, loss_fn: Any, loss_scale: float = 1.0, num_samples: int | None = None) -> dict: ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self) -> dict[str, float]: ...

    def ema_step(self) -> None: ...

    def ema_weights(self) -> Any: ...

    def save_checkpoint(self, root: Any, step: int | None = None, extra: dict | None = None) -> Any: ...

    def find_latest(self, root: Any) -> Any: ...

    def load_checkpoint(self, path: Any) -> dict[str, Any]: ...
