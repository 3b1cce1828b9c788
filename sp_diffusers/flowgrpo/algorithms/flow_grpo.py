"""Flow-GRPO (arXiv 2505.05470; yifan123/flow_grpo): a window of W SDE steps at a start drawn per iteration from
``flowgrpo.window_range``, ODE elsewhere; every window step trained against its stored log-prob with the clipped
ratio objective (``base.Algorithm.step_loss``); advantages over the batch's population std + 1e-4. The step is
flow_grpo's SDE step or its coefficients-preserving one (``flowgrpo.sde_type: cps``)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ConfigError, TrainConfig
from .base import Algorithm

__all__ = ["FlowGRPO"]

SDE_TYPES = ("sde", "cps")


class FlowGRPO(Algorithm):
    name = "flow_grpo"

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        if g.sde_type not in SDE_TYPES:
            raise ConfigError(
                f"flowgrpo.sde_type={g.sde_type!r}: choose 'sde' (flow_grpo's default) or 'cps' (coefficients-preserving)"
            )
        if g.sde_type == "cps" and not g.noise_level < 1:
            raise ConfigError(
                f"flowgrpo.noise_level={g.noise_level!r} must be < 1 with sde_type=cps (the angle a pi / 2); flow_grpo "
                "uses 0.8"
            )
        lo, hi = g.window_range[0], g.window_range[-1]
        if not (0 <= lo < hi <= g.num_steps - g.window_size + 1):
            raise ConfigError(
                f"flowgrpo.window_range={g.window_range} must satisfy 0 <= lo < hi <= num_steps - window_size + 1 "
                f"= {g.num_steps - g.window_size + 1}"
            )
        if g.sde_type == "cps" and g.kl_coef > 0 and hi + g.window_size - 2 >= g.num_steps - 1:
            # CPS's last step (sigma' = 0) has noise std 0: the KL divides by 0 (NaN on-policy, inf after)
            raise ConfigError(
                f"flowgrpo.sde_type=cps with flowgrpo.kl_coef={g.kl_coef} and flowgrpo.window_range={g.window_range}: a "
                f"window starting at {hi - 1} reaches the last step (sigma' = 0), where CPS is deterministic (noise std 0)"
                f" and the KL term divides by 0; fix: flowgrpo.window_range=[{lo}, {g.num_steps - g.window_size}] (the "
                "window ends before the last step), or flowgrpo.kl_coef=0"
            )

    def plan(self, batch: dict[str, Any], gen: torch.Generator) -> None:
        lo, hi = self.g.window_range
        batch["window_start"] = int(torch.randint(lo, hi, (1,), generator=gen))

    def _starts(self, trainable: set[int]) -> list[int]:
        g = self.g
        return [s for s in range(*g.window_range) if all(s + k in trainable for k in range(g.window_size))]

    def share_plan(self, batch: dict[str, Any], trainable: set[int], gen: torch.Generator) -> None:
        starts = self._starts(trainable)
        batch["window_start"] = starts[int(torch.randint(len(starts), (1,), generator=gen))]

    def check_trainable(self, trainable: set[int], owners: dict[int, str], trained: list[str]) -> None:
        g = self.g
        if self._starts(trainable):
            return
        starts = [
            s for s in range(g.num_steps - g.window_size + 1) if all(s + k in trainable for k in range(g.window_size))
        ]
        hint = f"flowgrpo.window_range=[{starts[0]}, {starts[-1] + 1}]" if starts else "a smaller flowgrpo.window_size"
        raise ConfigError(
            f"model.experts={trained}: no trainable window in flowgrpo.window_range={g.window_range} "
            f"(window {g.window_size}); the schedule's steps run on {owners}; fix: {hint} (the trained expert's "
            "steps), or train both experts"
        )
