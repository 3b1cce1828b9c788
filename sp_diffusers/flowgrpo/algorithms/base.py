"""The seam between the training loop and an RL algorithm: what the loop asks of an algorithm at each phase.

An algorithm is one module with one :class:`Algorithm` subclass (``algorithms/registry.py`` names them for
``flowgrpo.algorithm``). The loop (``trainer.py``, ``collect.py``, ``update.py``), the engine and the data and
reward I/O call these methods and never name an algorithm:

    config       ``check`` (its own keys), ``schedule_kind`` (``flowgrpo.schedule: auto``), ``step_rule``
    batch        ``plan``: what the iteration's generator draws for it (a window start, the steps to train), on
                 the host, the same on the ranks of an SP group; ``plan_iteration``: what depends on the iteration
                 itself, the same on every rank (a window that moves with training); ``share_plan``: the same on
                 every rank where two experts need it (``models/experts.py``)
    lifecycle    ``attach``: once the engine is built, and again after a checkpoint is loaded (state the algorithm keeps
                 beside the trained model, such as DiffusionNFT's old policy); ``after_update``: after an
                 iteration's optimizer steps
    rollout      ``span`` (which steps are stochastic, for every sample or per sample; the rest are ODE),
                 ``ode_solver`` (the solver of the rest: Euler unless it says otherwise), ``tail`` (or DPM-Solver++ on
                 fewer steps after the span), ``rollout_engine`` (the policy that samples), ``store`` (what the update
                 reads beyond the span, kept on the trajectory), ``final_is_prediction`` (the reward reads the last
                 predicted data, not the last latent) and ``keeps_old_means`` (the old policy's step means are stored
                 beside its log-probs: ``traj.old_means``)
    advantages   ``advantages`` from every data-parallel rank's rewards and prompt groups; ``drops_zero_advantage``
    update       ``step_loss``: the loss of one trained step of some samples from the stored rollout and the current
                 policy, in the form ``FSDPEngine.forward_backward`` takes, with its metrics; ``uses_log_probs``:
                 whether it reads the rollout's (old) log-probs, which the loop then computes
    metrics      ``iteration_metrics``: the iteration's choices (where its window is)

The base class is the Flow-GRPO family's shared part: the clipped ratio objective of a stored SDE step, with the
optional KL to the adapters-off reference. A new algorithm subclasses it and overrides what differs; its
reference test holds its formulas to the reference code's in fp64 (``tests/test_flowgrpo_reference_checks.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ...parallel.ledger import comm_phase
from ..config import ConfigError, TrainConfig
from ..sampling.dpm import DPMTail
from ..sampling.rollout import Trajectory, evaluate_window_step
from ..sampling.sde import StepRule
from .advantages import group_advantages
from .loss import flowgrpo_loss

__all__ = ["Algorithm", "StepContext"]


class StepContext:
    """What a step loss reads beside the samples: the adapter, schedule, step rule and config of the run."""

    def __init__(self, adapter: Any, schedule: Any, rule: StepRule, config: TrainConfig) -> None:
        self.adapter, self.schedule, self.rule, self.config = adapter, schedule, rule, config
        self.g = config.flowgrpo
        self.cfg_batch = config.rollout.cfg_batch


class Algorithm:
    """The Flow-GRPO family's defaults; subclasses override what their reference does differently."""

    name: ClassVar[str] = ""
    schedule_kind: ClassVar[str] = "pipeline"  # flowgrpo.schedule: auto -> the family's pipeline schedule
    final_is_prediction: ClassVar[bool] = False
    uses_log_probs: ClassVar[bool] = True  # a ratio to the rollout's log-probs (False: none stored, none recomputed)
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
    def plan(self, batch: dict[str, Any], gen: torch.Generator) -> None:
        """Draw this iteration's choices into ``batch`` from ``gen`` (seeded by the iteration and the dp rank)."""

    def plan_iteration(self, batch: dict[str, Any], iteration: int, gen: torch.Generator) -> None:
        """Draw into ``batch`` what depends on the training iteration (a window that moves as training goes on),
        from ``gen`` seeded by the iteration alone: the same on every rank. Default: nothing."""

    def share_plan(self, batch: dict[str, Any], trainable: set[int], gen: torch.Generator) -> None:
        """Redraw the choices from ``gen`` (the iteration's alone) among the ``trainable`` schedule steps, the same on
        every rank: two experts are sharded over every rank, which must run the same one at a time."""
        raise ConfigError(f"flowgrpo.algorithm={self.name!r} does not train a two-expert model yet")

    def check_trainable(self, trainable: set[int], owners: dict[int, str], trained: list[str]) -> None:
        """Refuse a run whose trained steps never reach a trained expert (two experts)."""

    # --------------------------------------------------------------------------------------- lifecycle
    def attach(self, engine: Any) -> None:
        """Called when the trainer has built ``engine`` and again after it loaded a checkpoint into it: build or
        refresh what the algorithm keeps beside the trained model (the Flow-GRPO family keeps nothing)."""

    def after_update(self, engine: Any) -> dict[str, float]:
        """Called after an iteration's optimizer steps; its metrics join the iteration's."""
        return {}

    # ----------------------------------------------------------------------------------------- rollout
    def span(self, batch: dict[str, Any], num_steps: int) -> tuple[int | list[int], int]:
        """``(start, size)``: the rollout's stochastic steps (their latents and log-probs are stored); ``start`` a
        host list of one start per sample when each sample has its own window (``sampling/rollout.py``)."""
        return int(batch["window_start"]), self.g.window_size

    def ode_solver(self) -> Any:
        """A fresh solver (``step(x, v, sigmas, i) -> x'``) for one rollout's deterministic steps; None: Euler
        (``sampling.sde.ode_step``)."""
        return None

    def rollout_engine(self, engine: Any) -> Any:
        """The engine whose policy samples the rollout (the trained one: on-policy)."""
        return engine

    def store(self, traj: Trajectory, batch: dict[str, Any]) -> None:
        """Keep in ``traj.extras`` what ``step_loss`` reads beyond the span (here: nothing)."""

    def drops_zero_advantage(self) -> bool:
        """Whether samples of advantage 0 are left out of the update (``flowgrpo.drop_zero_advantage``: with a
        ratio objective their gradient is 0)."""
        return self.g.drop_zero_advantage

    def keeps_old_means(self) -> bool:
        """Whether the loss reads the old policy's step means (``traj.old_means`` ``[B, T, ...]``, beside the old
        log-probs: from their recomputation, or stored by the rollout when they are not recomputed)."""
        return False

    def tail(self, batch: dict[str, Any], schedule: Any) -> DPMTail | None:
        """The solver of the steps after the span: None, Euler ODE steps on the schedule; a ``DPMTail``,
        DPM-Solver++ on its compressed sigmas (``sampling/dpm.py``)."""
        return None

    def iteration_metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """This iteration's choices as metrics (e.g. where its window is). Default: none."""
        return {}

    # -------------------------------------------------------------------------------------- advantages
    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """``[N]`` advantages of every data-parallel rank's rewards (flow_grpo: the batch's population std +
        1e-4, clamped)."""
        return group_advantages(rewards, groups, std="batch", eps=1e-4, clip=self.g.adv_clip_max, correction=0)

    # ------------------------------------------------------------------------------------------ update
    def kl_std(self, std_dev_t: torch.Tensor, schedule: Any, steps: torch.Tensor) -> torch.Tensor:
        """The ``[b]`` std the KL term divides by (flow_grpo: the step's ``std_dev_t``, no ``dt`` factor)."""
        return std_dev_t

    def step_loss(
        self,
        engine: Any,
        _batch: Any,
        *,
        ctx: StepContext,
        traj: Trajectory,
        k: int,
        idx: torch.Tensor,
        cond: dict[str, Any],
        advantages: torch.Tensor,
        old_log_probs: torch.Tensor,
        normalizer: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy loss (+ KL to the adapters-off reference) of the k-th trained step of samples ``idx``
        (the ``loss_fn`` form ``FSDPEngine.forward_backward`` takes; the engine's batch argument is unused)."""
        g = ctx.g
        steps, latents, next_latents = traj.step_latents(idx, k)

        def evaluate():
            return evaluate_window_step(
                engine, ctx.adapter, latents, next_latents, ctx.schedule, steps, cond, ctx.rule, g.cfg_scale,
                ctx.cfg_batch,
            )

        step = evaluate()
        kl_args = {}
        if g.kl_coef > 0:
            with torch.no_grad(), engine.adapters_disabled(), comm_phase("reference"):
                ref = evaluate()  # the reference policy: the base model, adapters off
            kl_args = dict(
                prev_sample_mean=step.prev_sample_mean,
                ref_prev_sample_mean=ref.prev_sample_mean,
                std_dev_t=self.kl_std(step.std_dev_t, ctx.schedule, steps),
            )
        return flowgrpo_loss(
            step.log_prob,
            old_log_probs[idx, k],
            advantages[idx],
            clip_range=g.clip_range,
            normalizer=normalizer,
            kl_coef=g.kl_coef,
            **kl_args,
        )
