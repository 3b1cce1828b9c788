"""DanceGRPO (arXiv 2505.07818; XueZeyue/DanceGRPO, verl-omni's ``dance_grpo``): every step an SDE step with
DanceGRPO's own step rule on its shifted-linspace schedule; each sample trains on its own random subset of
``int((N - 1) * timestep_fraction)`` steps of 0..N-2 (the last never); advantages over each prompt group's unbiased
std + 1e-8; the reward reads the last step's predicted data. The KL scale is ``flowgrpo.dance.kl``."""

from __future__ import annotations

from typing import Any

import torch

from ..batch import IterationBatch, StepPlan
from ..config import ConfigError, TrainConfig
from ..sampling.denoise import Span
from ..sampling.sde import StepRule
from .advantages import group_advantages
from .base import Algorithm, StepInputs

__all__ = ["DANCE_KL", "DanceGRPO"]

DANCE_KL = ("verl_omni", "flow_grpo")


class DanceGRPO(Algorithm):
    name = "dance_grpo"
    section = "dance"
    ignores = ("window_size", "window_range", "per_sample_windows", "sde_steps")  # every step is SDE
    schedule_kind = "linspace"
    final_is_prediction = True
    default_timestep_fraction = 0.6  # DanceGRPO's scripts

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        if g.sde_type != "sde":
            raise ConfigError(
                f"flowgrpo.sde_type={g.sde_type!r} is a flow_grpo step; dance_grpo takes its own (DanceGRPO's SDE); "
                "fix: remove flowgrpo.sde_type or set flowgrpo.algorithm=flow_grpo"
            )
        if g.dance.kl not in DANCE_KL:
            raise ConfigError(
                f"flowgrpo.dance.kl={g.dance.kl!r}: choose 'verl_omni' (KL / (eta^2 (sigma - sigma')), the Gaussian KL "
                "of the step) or 'flow_grpo' (KL / eta^2, no dt factor)"
            )
        if not (0 <= g.timestep_fraction <= 1):
            raise ConfigError(
                f"flowgrpo.timestep_fraction={g.timestep_fraction!r} must be in (0, 1] (0: DanceGRPO's 0.6)"
            )
        fraction = cls.timestep_fraction(config)
        if int((g.num_steps - 1) * fraction) < 1:
            raise ConfigError(
                f"flowgrpo.timestep_fraction={fraction} x (num_steps - 1 = {g.num_steps - 1}) trains no "
                "step; fix: raise flowgrpo.timestep_fraction or flowgrpo.num_steps"
            )

    def step_rule(self) -> StepRule:
        return StepRule("dance", self.g.noise_level)

    def _count(self) -> int:
        return int((self.g.num_steps - 1) * self.timestep_fraction(self.config))

    def plan(self, batch: IterationBatch, gen: torch.Generator, iteration: int, shared: torch.Generator) -> None:
        # each sample its own random subset (without replacement) of steps 0..N-2
        n, count = self.g.num_steps - 1, self._count()
        batch.plan.window_start = 0
        batch.plan.train_steps = torch.stack([torch.randperm(n, generator=gen)[:count] for _ in range(len(batch))])

    def share_plan(self, batch: IterationBatch, trainable: set[int], gen: torch.Generator) -> None:
        # one subset for the whole batch: every rank trains the same expert at a time
        candidates = torch.tensor([s for s in range(self.g.num_steps - 1) if s in trainable])
        steps = candidates[torch.randperm(len(candidates), generator=gen)[: min(len(candidates), self._count())]]
        batch.plan.train_steps = steps.expand(len(batch), -1).clone()
        batch.plan.host_steps = steps.tolist()

    def check_trainable(self, trainable: set[int], owners: dict[int, str], trained: list[str]) -> None:
        if not any(s in trainable for s in range(self.g.num_steps - 1)):
            raise ConfigError(
                f"model.experts={trained}: no trainable step in 0..{self.g.num_steps - 2} (DanceGRPO never trains the "
                f"last); the schedule's steps run on {owners}; fix: train both experts"
            )

    def span(self, plan: StepPlan, schedule: Any) -> Span:
        return Span(0, schedule.num_steps, self.step_rule())

    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return group_advantages(rewards, groups, std="group", eps=1e-8, clip=self.g.adv_clip_max, correction=1)

    def kl_std(self, step: StepInputs) -> torch.Tensor:
        """``dance.kl: verl_omni``: the Gaussian KL of the two steps, ``eta sqrt(sigma - sigma')`` (the std of the
        step's noise, as verl-omni's ``dance_sde`` divides by); ``flow_grpo``: ``eta`` (no ``dt`` factor), a KL
        ``1 / (sigma - sigma')`` times smaller."""
        assert step.std_dev_t is not None and step.sqrt_dt is not None
        if self.g.dance.kl != "verl_omni":
            return step.std_dev_t
        return step.std_dev_t * step.sqrt_dt
