"""An exponential moving average of the trained parameters, kept sharded beside them (flow_grpo's ``ema``).

Each trained parameter gets a detached copy with the same sharding (FSDP2: the same DTensor shard of the same
rows), so an update is elementwise on this rank's shard: no collective, no host sync. The decay follows
flow_grpo's ``EMAModuleWrapper``: at optimizer step ``s`` it is ``min((1 + s) / (10 + s), decay)`` and an update
happens when ``(s + 1) % interval == 0`` (flow_grpo: decay 0.9, every 8 steps, "the previous 20 x 8 = 160 steps
on average"). The trainer updates it after every micro-batch, as flow_grpo steps it, and swaps the averaged
weights in for evaluation and sample grids (:meth:`ParameterEMA.swapped`); checkpoints keep it under ``ema.``, so a
resumed run continues the same average, and ``sp-diffusers export`` writes it where the run kept one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["ParameterEMA"]


class ParameterEMA:
    """The averaged copies of ``params`` (name -> trained parameter)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float, interval: int) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema decay={decay!r} must be in [0, 1); flow_grpo uses 0.9")
        if interval < 1:
            raise ValueError(f"ema interval={interval!r} must be >= 1 optimizer steps; flow_grpo uses 8")
        self.params, self.decay, self.interval = params, float(decay), int(interval)
        with torch.no_grad():
            self.averages = {name: p.detach().clone() for name, p in params.items()}

    @torch.no_grad()
    def reset(self) -> None:
        """Every average equal to its parameter again."""
        for name, p in self.params.items():
            self.averages[name].copy_(p.detach())

    def current_decay(self, step: int) -> float:
        return min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def step(self, optimizer_step: int) -> None:
        """Move every average toward its parameter by ``1 - decay`` at this optimizer step (on the interval)."""
        if (optimizer_step + 1) % self.interval:
            return
        weight = 1.0 - self.current_decay(optimizer_step)
        for name, p in self.params.items():
            self.averages[name].lerp_(p.detach(), weight)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside: the parameters hold the averages (their own values kept aside, put back after)."""
        kept = {}
        with torch.no_grad():
            for name, p in self.params.items():
                kept[name] = p.detach().clone()
                p.copy_(self.averages[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(kept[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averages
