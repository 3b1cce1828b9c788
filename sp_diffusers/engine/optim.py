"""What an engine trains with: AdamW over the trainable parameters, its warmup schedule, and an optional moving
average of them (``engine/ema.py``). A frozen engine (``EngineSettings(frozen=True)``) gets none of them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.ledger import comm_kind
from .ema import ParameterEMA
from .settings import EngineSettings

__all__ = ["average_replicated_grads", "training_state"]


def training_state(
    model: torch.nn.Module, settings: EngineSettings
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer | None, object | None, ParameterEMA | None]:
    """``(trainable parameters, AdamW, LR schedule, EMA)``; a model with nothing to train is refused unless it is
    frozen (then ``([], None, None, None)``)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if settings.frozen:
        return trainable, None, None, None
    if not trainable:
        raise ValueError(
            "the model has no trainable parameters; fix: EngineSettings(frozen=True) for one that is not trained"
        )
    o = settings.optim
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    scheduler = lr_schedule(optimizer, o.warmup_steps)
    ema = None
    if settings.ema_decay is not None:
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        ema = ParameterEMA(named, settings.ema_decay, settings.ema_interval)
    return trainable, optimizer, scheduler, ema


def lr_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate at optimizer step s: linear warm-up over ``warmup_steps``, then constant; from step 0 (a
    schedule made again for an optimizer that stepped starts over from its initial learning rate)."""
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", group["lr"])
    warmup = max(0, warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)


def average_replicated_grads(trainable: list[torch.nn.Parameter], dp: int) -> None:
    """Without FSDP every rank holds whole gradients: SUM them over the world and divide by dp (SUM over the SP
    group, MEAN over data parallelism: the engine's gradient contract)."""
    with comm_kind("grad_reduce"):
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(dp)
