"""Flow-GRPO (arXiv 2505.05470; yifan123/flow_grpo). Which rollout steps are SDE steps, ``flowgrpo.sde_steps``:

- ``window`` (Flow-GRPO-Fast, flow_grpo's ``*_fast`` scripts): a window of W SDE steps at a start drawn per iteration
  from ``flowgrpo.window_range`` ``[lo, hi)``, ODE elsewhere; every window step is trained. With
  ``flowgrpo.per_sample_windows`` each sample draws its own start (verl-omni's ``sample_per_sample_sde_windows``:
  one generator per sample, every window W steps); otherwise one window for the batch.
- ``all`` (flow_grpo's ``train_sd3.py``, and GRPO-Guard's): every step is an SDE step, and the first
  ``int(N * timestep_fraction)`` steps are trained, in order, by every sample (an early flow_grpo shuffled them).
- ``auto``: the algorithm's own (``default_sde_steps``): ``window`` here, ``all`` for GRPO-Guard.

Every trained step is held against its stored log-prob with the clipped ratio objective (``base.Algorithm.step_loss``);
advantages over the batch's population std + 1e-4. The step is flow_grpo's SDE step or its coefficients-preserving
one (``flowgrpo.sde_type: cps``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..batch import IterationBatch, StepPlan
from ..config import ConfigError, TrainConfig
from ..sampling.denoise import Span
from .base import Algorithm

__all__ = ["SDE_STEPS", "FlowGRPO"]

SDE_TYPES = ("sde", "cps")
SDE_STEPS = ("auto", "window", "all")


class FlowGRPO(Algorithm):
    name = "flow_grpo"
    takes_kl_reward = True
    trains_lagged = True  # a clipped ratio to the rollout's log-probs (GRPO-Guard and Flow-DPPO inherit it)
    default_sde_steps: ClassVar[str] = "window"  # flowgrpo.sde_steps: auto -> this

    @classmethod
    def sde_steps(cls, config: TrainConfig) -> str:
        """``window`` or ``all``: ``flowgrpo.sde_steps``, with ``auto`` resolved to this algorithm's."""
        mode = config.flowgrpo.sde_steps
        return cls.default_sde_steps if mode == "auto" else mode

    @classmethod
    def ignored(cls, config: TrainConfig) -> tuple[str, ...]:
        """``window``: every window step trains (no ``timestep_fraction``); ``all``: no window."""
        if cls.sde_steps(config) == "all":
            return (*cls.ignores, "window_size", "window_range")
        return (*cls.ignores, "timestep_fraction")

    @classmethod
    def trained_count(cls, config: TrainConfig) -> int:
        """``all``: how many of the first steps train, ``int(N * timestep_fraction)`` (flow_grpo's rounding)."""
        return int(config.flowgrpo.num_steps * cls.timestep_fraction(config))

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
        if g.sde_steps not in SDE_STEPS:
            raise ConfigError(
                f"flowgrpo.sde_steps={g.sde_steps!r}: choose 'window' (an SDE window, ODE elsewhere), 'all' (every step "
                f"SDE, the first int(N * timestep_fraction) trained) or 'auto' ({cls.name}: {cls.default_sde_steps})"
            )
        if cls.sde_steps(config) == "all":
            cls._check_all(config)
        else:
            cls._check_window(config)

    @classmethod
    def _check_all(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        if g.per_sample_windows:
            raise ConfigError(
                "flowgrpo.per_sample_windows=true draws a window per sample, but flowgrpo.sde_steps resolves to 'all' "
                f"(every step SDE, for {cls.name}); fix: flowgrpo.sde_steps=window, or per_sample_windows=false"
            )
        if not 0 <= g.timestep_fraction <= 1:
            raise ConfigError(
                f"flowgrpo.timestep_fraction={g.timestep_fraction!r} must be in (0, 1] (0: {cls.name}'s "
                f"{cls.default_timestep_fraction}); flow_grpo's configs use 0.99"
            )
        count = cls.trained_count(config)
        if count < 1:
            raise ConfigError(
                f"flowgrpo.timestep_fraction={cls.timestep_fraction(config)} x num_steps={g.num_steps} trains no step "
                "(int(N * fraction) = 0); fix: raise flowgrpo.timestep_fraction or flowgrpo.num_steps"
            )
        if g.sde_type == "cps" and g.kl_coef > 0 and count == g.num_steps:
            raise ConfigError(
                f"flowgrpo.sde_type=cps with flowgrpo.kl_coef={g.kl_coef} trains the last step (timestep_fraction "
                f"{cls.timestep_fraction(config)}), where CPS is deterministic (noise std 0) and the KL term divides by "
                "0; fix: flowgrpo.timestep_fraction=0.99 (the last step untrained), or flowgrpo.kl_coef=0"
            )

    @classmethod
    def _check_window(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
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

    # ------------------------------------------------------------------------------------------- batch
    def plan(self, batch: IterationBatch, gen: torch.Generator, iteration: int, shared: torch.Generator) -> None:
        b = len(batch)
        if self.sde_steps(self.config) == "all":
            count = self.trained_count(self.config)
            batch.plan.window_start = 0
            batch.plan.train_steps = torch.arange(count).expand(b, count).clone()
            batch.plan.host_steps = list(range(count))  # every sample the same steps: known on the host
            return
        lo, hi = self.g.window_range
        if self.g.per_sample_windows:
            # one generator per sample (verl-omni draws each row's window from the row's own generator): a sample's
            # window does not depend on the other samples of the batch
            base = int(torch.randint(2**62, (1,), generator=gen))
            starts = [
                int(torch.randint(lo, hi, (1,), generator=torch.Generator().manual_seed(base + i))) for i in range(b)
            ]
            batch.plan.window_starts = starts
            batch.plan.train_steps = torch.tensor(starts)[:, None] + torch.arange(self.g.window_size)
            return
        batch.plan.window_start = int(torch.randint(lo, hi, (1,), generator=gen))

    def _starts(self, trainable: set[int]) -> list[int]:
        g = self.g
        return [s for s in range(*g.window_range) if all(s + k in trainable for k in range(g.window_size))]

    def share_plan(self, batch: IterationBatch, trainable: set[int], gen: torch.Generator) -> None:
        if self.sde_steps(self.config) == "all":
            steps = [s for s in range(self.trained_count(self.config)) if s in trainable]
            batch.plan.train_steps = torch.tensor(steps).expand(len(batch), -1).clone()
            batch.plan.host_steps = steps
            return
        if self.g.per_sample_windows:
            raise ConfigError(
                "flowgrpo.per_sample_windows=true with two experts: every rank must run the same expert at a time, "
                "and per-sample windows put one micro-batch's samples on different steps; fix: "
                "flowgrpo.per_sample_windows=false"
            )
        starts = self._starts(trainable)
        batch.plan.window_start = starts[int(torch.randint(len(starts), (1,), generator=gen))]

    def check_trainable(self, trainable: set[int], owners: dict[int, str], trained: list[str]) -> None:
        g = self.g
        if self.sde_steps(self.config) == "all":
            count = self.trained_count(self.config)
            if any(s in trainable for s in range(count)):
                return
            raise ConfigError(
                f"model.experts={trained}: none of the trained steps 0..{count - 1} (int(N * timestep_fraction)) runs "
                f"on a trained expert; the schedule's steps run on {owners}; fix: train both experts"
            )
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

    # ----------------------------------------------------------------------------------------- rollout
    def span(self, plan: StepPlan, schedule: Any) -> Span:
        if self.sde_steps(self.config) == "all":
            return Span(0, schedule.num_steps, self.step_rule())
        if plan.window_starts is not None:  # one start per sample
            return Span(list(plan.window_starts), self.g.window_size, self.step_rule())
        return Span(plan.window_start, self.g.window_size, self.step_rule())
