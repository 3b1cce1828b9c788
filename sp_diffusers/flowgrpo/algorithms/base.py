"""The seam between the training loop and an RL algorithm: an algorithm is a loss plus its choices.

An algorithm is one module with one :class:`Algorithm` subclass (``algorithms/registry.py`` names them for
``flowgrpo.algorithm``). The loop (``trainer.py``, ``update.py``) runs the model; it asks the algorithm:

    config       ``check`` (its own keys), ``schedule_kind`` (``flowgrpo.schedule: auto``), ``step_rule``
    batch        ``plan``: its choices for the iteration (a window start, the steps to train), drawn on the host,
                 the same on the ranks of an SP group; ``share_plan``: the same on every rank where two experts
                 need it (``models/experts.py``); ``iteration_metrics``: the choices as metrics
    rollout      ``span``: which steps are stochastic and how the others step (``sampling.denoise.Span``);
                 ``rollout_engine`` (the policy that samples); ``final_is_prediction`` (the rewards read the last
                 predicted data)
    advantages   ``advantages_of`` every data-parallel rank's rewards (:class:`RewardTable`; by default ``advantages``
                 of their weighted total and prompt groups), ``image_features`` (a vision model whose features of each
                 sample the table carries: GARDO), ``kl_rows`` (the samples a KL term applies to); ``kept``: the samples
                 the update trains, in its order (the zero-advantage filter; Diffusion-DPO's pairs), and
                 ``pair_units`` (the update's shuffle and micro-batches keep neighbours 2k, 2k + 1 together)
    update       ``inputs``: what the loop evaluates for a trained step (:class:`Inputs`: the stored step's log-prob
                 under the policy, or the velocities at noised data, ``forward_point`` saying where; the old
                 log-probs and step means; the reference policy); ``loss``: a pure function of the evaluated
                 :class:`StepInputs` and the fixed :class:`Targets`, with its metrics
    lifecycle    ``attach`` (once the engine is built, and after a checkpoint is loaded: state kept beside the
                 trained model, such as DiffusionNFT's old policy); ``after_update`` (with the update's metrics);
                 ``state`` / ``load_state`` (what a checkpoint keeps of the algorithm's own counters)

The base class is the Flow-GRPO family's shared part: the clipped ratio objective of a stored SDE step, with the
optional KL to the adapters-off reference. A new algorithm subclasses it and overrides what differs; its reference
test holds its formulas to the reference code's in fp64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..batch import IterationBatch, StepPlan
from ..config import ConfigError, TrainConfig
from ..sampling.denoise import Sampler, Span
from ..sampling.sde import StepRule
from .advantages import group_advantages
from .loss import flowgrpo_loss
from .selection import kept_samples

__all__ = ["Algorithm", "Inputs", "RewardTable", "StepContext", "StepInputs", "Targets"]


class StepContext:
    """What evaluating a trained step reads beside the samples: the adapter, schedule, step rule and config of the
    run."""

    def __init__(self, adapter: Any, schedule: Any, rule: StepRule, config: TrainConfig) -> None:
        self.adapter, self.schedule, self.rule, self.config = adapter, schedule, rule, config
        self.g = config.flowgrpo
        self.cfg_batch = config.rollout.cfg_batch

    def sampler(self, engine: Any) -> Sampler:
        """``engine``'s policy as the rollout samples it (the run's guidance, no held weights)."""
        return Sampler(engine, self.adapter, self.schedule, self.g.cfg_scale, self.cfg_batch)


@dataclass(frozen=True)
class Inputs:
    """What an algorithm's loss reads, declared: the loop computes these and nothing else.

    ``evaluation``: ``"sde_step"`` (the stored transition's log-prob and step mean under the policy) or
    ``"forward_process"`` (the policy's velocity at the final data noised as ``Algorithm.forward_point`` says:
    DiffusionNFT, Diffusion-DPO). ``old_log_probs``: the rollout policy's log-prob of each trained step (recomputed
    by the actor, or the rollout's own); ``old_means``: its step means beside them; ``old_velocity``: the rollout
    policy's velocity at the noised data (DiffusionNFT). ``reference``: the adapters-off policy at the same inputs
    (a KL term, Diffusion-DPO's reference errors)."""

    evaluation: str = "sde_step"
    old_log_probs: bool = True
    old_means: bool = False
    old_velocity: bool = False
    reference: bool = False


@dataclass
class StepInputs:
    """One trained step of a micro-batch as the loop evaluated it (the policy's side of the loss; ``[b]`` or
    ``[b, ...]``). ``sde_step``: ``log_prob``, ``prev_sample_mean``, ``std_dev_t`` and ``sqrt_dt`` (the step's
    ``sqrt(sigma - sigma')``), ``ref_prev_sample_mean``; ``forward_process``: ``x0``, ``x_t``, ``t`` (the sigma),
    ``v`` (with the gradient), ``v_old``, ``v_ref``. ``steps``: each sample's schedule step."""

    steps: torch.Tensor
    log_prob: torch.Tensor | None = None
    prev_sample_mean: torch.Tensor | None = None
    std_dev_t: torch.Tensor | None = None
    sqrt_dt: torch.Tensor | None = None
    ref_prev_sample_mean: torch.Tensor | None = None
    x0: torch.Tensor | None = None
    x_t: torch.Tensor | None = None
    t: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    v: torch.Tensor | None = None
    v_old: torch.Tensor | None = None
    v_ref: torch.Tensor | None = None


@dataclass
class Targets:
    """What the rollout and the rewards fixed for the same samples: ``advantages [b]``, as declared by :class:`Inputs`
    the old log-probs ``[b]`` and the old step means ``[b, ...]``, and ``kl_rows [b]`` (bool: the samples a KL term
    applies to, where the algorithm gates it: ``Algorithm.kl_rows``)."""

    advantages: torch.Tensor
    old_log_prob: torch.Tensor | None = None
    old_prev_sample_mean: torch.Tensor | None = None
    kl_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class RewardTable:
    """Every data-parallel rank's rollout scored, rank-major: the weighted total ``[N]``, each configured reward by
    name ``[N]``, each sample's prompt group ``[N]`` and, where the algorithm asks (``Algorithm.image_features``), each
    sample's features ``[N, D]``."""

    total: torch.Tensor
    groups: torch.Tensor
    each: dict[str, torch.Tensor] = field(default_factory=dict)
    features: torch.Tensor | None = None


class Algorithm:
    """The Flow-GRPO family's defaults; subclasses override what their reference does differently."""

    name: ClassVar[str] = ""
    section: ClassVar[str | None] = None  # its own keys: flowgrpo.<section>.* (read by no other algorithm)
    takes_kl_reward: ClassVar[bool] = False  # flowgrpo.kl_reward: per-step advantages of a stored SDE step's KL
    pair_units: ClassVar[bool] = False  # the update keeps samples 2k, 2k + 1 of ``kept`` in one micro-batch
    # update.lag=1 trains a rollout one optimizer step old: only a loss that clips its ratio to the rollout policy's
    # log-probs stays correct there (it keeps nothing else of the policy that sampled)
    trains_lagged: ClassVar[bool] = False
    # the shared flowgrpo keys this algorithm does not read: set away from their defaults, they are refused
    ignores: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def ignored(cls, config: TrainConfig) -> tuple[str, ...]:
        """The shared ``flowgrpo`` keys this run's algorithm does not read (``ignores``, and what its settings
        leave unread)."""
        return cls.ignores
    schedule_kind: ClassVar[str] = "pipeline"  # flowgrpo.schedule: auto -> the family's pipeline schedule
    final_is_prediction: ClassVar[bool] = False
    default_timestep_fraction: ClassVar[float] = 0.99  # flowgrpo.timestep_fraction: 0 -> this (the reference's)

    def __init__(self, config: TrainConfig) -> None:
        self.config, self.g = config, config.flowgrpo

    # ------------------------------------------------------------------------------------------ config
    @classmethod
    def check(cls, config: TrainConfig) -> None:
        """Refuse this algorithm's keys where they cannot train (``ConfigError`` naming the key and the fix)."""

    @classmethod
    def timestep_fraction(cls, config: TrainConfig) -> float:
        """``flowgrpo.timestep_fraction``, or this algorithm's reference value where it is left at 0."""
        return config.flowgrpo.timestep_fraction or cls.default_timestep_fraction

    def step_rule(self) -> StepRule:
        return StepRule(self.g.sde_type, self.g.noise_level)

    # ------------------------------------------------------------------------------------------- batch
    def plan(self, batch: IterationBatch, gen: torch.Generator, iteration: int, shared: torch.Generator) -> None:
        """Draw this iteration's choices into ``batch.plan``: from ``gen`` (seeded by the iteration and the dp rank) what
        may differ across data-parallel ranks, from ``shared`` (the iteration's alone) what must not (a window that
        moves as training goes on)."""

    def share_plan(self, batch: IterationBatch, trainable: set[int], gen: torch.Generator) -> None:
        """Redraw the choices from ``gen`` (the iteration's alone) among the ``trainable`` schedule steps, the same on
        every rank: two experts are sharded over every rank, which must run the same one at a time."""
        raise ConfigError(f"flowgrpo.algorithm={self.name!r} does not train a two-expert model yet")

    def check_trainable(self, trainable: set[int], owners: dict[int, str], trained: list[str]) -> None:
        """Refuse a run whose trained steps never reach a trained expert (two experts)."""

    def iteration_metrics(self, plan: StepPlan) -> dict[str, float]:
        """This iteration's choices as metrics (e.g. where its window is). Default: none."""
        return {}

    # --------------------------------------------------------------------------------------- lifecycle
    def attach(self, engine: Any) -> None:
        """Called when the trainer has built ``engine`` and again after it loaded a checkpoint into it: build or
        refresh what the algorithm keeps beside the trained model (the Flow-GRPO family keeps nothing)."""

    def after_update(self, engine: Any, metrics: dict[str, float]) -> dict[str, float]:
        """Called on every rank after an iteration's optimizer steps with the update's ``metrics`` (this rank's); what
        it returns joins the iteration's metrics."""
        return {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this algorithm's own counters (plain data; the weights it keeps are not)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` from a checkpoint (``{}``: one written without it)."""

    # ----------------------------------------------------------------------------------------- rollout
    def span(self, plan: StepPlan, schedule: Any) -> Span:
        """The rollout's stochastic steps (their latents and log-probs are stored) and how the others step."""
        return Span(plan.window_start, self.g.window_size, self.step_rule())

    def rollout_engine(self, engine: Any) -> Any:
        """The engine whose policy samples the rollout (the trained one: on-policy)."""
        return engine

    @contextlib.contextmanager
    def reference_policy(self, engine: Any) -> Iterator[Any]:
        """The engine to run as the reference policy inside (a KL term, Diffusion-DPO's errors): the trained model
        with its LoRA adapters off."""
        with engine.adapters_disabled():
            yield engine

    # -------------------------------------------------------------------------------------- advantages
    def image_features(self) -> str | None:
        """The vision model (a folder, or ``latents``: the final latents themselves) whose features of each sample
        :class:`RewardTable` carries; None: no features (every algorithm but GARDO)."""
        return None

    def advantages_of(self, table: RewardTable) -> torch.Tensor:
        """``[N]`` advantages of every data-parallel rank's scored rollout: :meth:`advantages` of the weighted total."""
        return self.advantages(table.total, table.groups)

    def kl_rows(self, table: RewardTable) -> torch.Tensor | None:
        """``[N]`` bool: the samples a KL term applies to (None: every sample)."""
        return None

    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """``[N]`` advantages of every data-parallel rank's rewards (flow_grpo: the batch's population std +
        1e-4, clamped)."""
        return group_advantages(rewards, groups, std="batch", eps=1e-4, clip=self.g.adv_clip_max, correction=0)

    def step_advantages(self, rewards: torch.Tensor, kl: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """``[N, T]`` advantages with each trained step's KL to the reference folded into its reward (flow_grpo's
        ``kl_reward``): ``R_t = R - kl_reward * KL_t``, each step's column through :meth:`advantages` (flow_grpo's
        stat tracker normalises every column on its own)."""
        per_step = rewards[:, None] - self.g.kl_reward * kl
        return torch.stack([self.advantages(per_step[:, t].contiguous(), groups) for t in range(kl.shape[1])], dim=1)

    def drops_zero_advantage(self) -> bool:
        """Whether samples of advantage 0 are left out of the update (``flowgrpo.drop_zero_advantage``: with a
        ratio objective their gradient is 0)."""
        return self.g.drop_zero_advantage

    def kept(self, per_sample_all: torch.Tensor, dp_rank: int, dp_size: int, seed: int) -> torch.Tensor | None:
        """This dp rank's samples the update trains, in the order it reads them (None: every sample), the same count
        on every rank; ``per_sample_all`` ``[dp_size * B]``: every rank's advantages (a sample's total over its
        steps where there are several). Default: the zero-advantage filter (``selection.kept_samples``)."""
        if not self.drops_zero_advantage():
            return None
        return kept_samples(per_sample_all, dp_rank, dp_size, self.g.mini_batches, seed)

    # ------------------------------------------------------------------------------------------ update
    def inputs(self) -> Inputs:
        """What :meth:`loss` reads (the loop evaluates these; the reference pass only where a KL term asks)."""
        return Inputs(reference=self.g.kl_coef > 0)

    def forward_point(
        self, traj: Any, k: int, idx: torch.Tensor, schedule: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where a ``forward_process`` algorithm evaluates samples ``idx`` at their k-th trained point: ``(sigma [b],
        model timestep [b] on the 0..1000 scale, noise [b, ...])`` with ``x_t = (1 - sigma) x0 + sigma noise``;
        ``schedule`` on the samples' device. The same on every rank of an SP group and for any micro-batching."""
        raise NotImplementedError(f"{self.name} trains stored SDE steps (Inputs.evaluation='sde_step')")

    def kl_std(self, step: StepInputs) -> torch.Tensor:
        """The ``[b]`` std the KL term divides by (flow_grpo: the step's ``std_dev_t``, no ``dt`` factor)."""
        assert step.std_dev_t is not None
        return step.std_dev_t

    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy loss (+ KL to the adapters-off reference) of one trained step, ``/ normalizer``."""
        kl_args = {}
        if self.g.kl_coef > 0:
            kl_args = dict(
                prev_sample_mean=step.prev_sample_mean,
                ref_prev_sample_mean=step.ref_prev_sample_mean,
                std_dev_t=self.kl_std(step),
            )
        return flowgrpo_loss(
            step.log_prob,
            targets.old_log_prob,
            targets.advantages,
            clip_range=self.g.clip_range,
            normalizer=normalizer,
            kl_coef=self.g.kl_coef,
            **kl_args,
        )
