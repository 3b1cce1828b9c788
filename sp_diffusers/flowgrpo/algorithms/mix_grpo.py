"""MixGRPO (arXiv 2507.21802; Tencent-Hunyuan/MixGRPO): Flow-GRPO's SDE step on a window of ``W`` steps whose start
moves as training goes on, Euler ODE before it, Euler or DPM-Solver++ (order 2, on a compressed tail: fewer model
calls) after it; only the window's steps are trained, with the clipped ratio objective against the rollout's
log-probs, plus an optional ``0.5 mean((log_prob - old_log_prob)^2)``; advantages over each prompt group's unbiased
std + 1e-8. Its schedule is DanceGRPO's shifted linspace (``flowgrpo.schedule: auto``), as the reference samples.

Where the window is, per iteration (the reference's ``GRPOTrainingStates``, ``fastvideo/utils/grpo_states.py``, with
``max = N - 2``): iteration ``i`` trains the steps ``range(start, min(start + W, max))`` of the state reached after
``i`` updates from ``start = 0``. An update counts the iteration in its group; after ``iters_per_group`` of them the
start moves by ``W`` (or by ``mix.prog_overlap_step`` with ``mix.prog_overlap``); past ``max`` it rolls back to 0
(``mix.roll_back``) or stays at ``max`` (whose window is empty: nothing is trained any more, the reference's
"training complete"). ``decay`` takes ``int(max_ipg (1 - start / max) + min_ipg start / max)`` iterations per move
(at least ``min_ipg``), ``exp_decay`` ``ceil(iters_per_group exp(-k relu(start - threshold)))``; ``random`` draws
the start uniformly from ``[0, max - W]`` at every update (iteration 0 keeps the initial 0). The state is a function
of the iteration alone (replayed from 0, remembered), so a resumed run continues where it stopped, and ``random``
draws from a generator seeded by the iteration: every rank, data-parallel ones included, trains the same steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..batch import IterationBatch, StepPlan
from ..config import TrainConfig, require
from ..sampling.denoise import Span
from ..sampling.dpm import DPM_SOLVER_TYPES, compressed_tail
from .advantages import group_advantages
from .base import Algorithm, StepInputs, Targets
from .loss import flowgrpo_loss

__all__ = ["MIX_STRATEGIES", "MIX_TAIL_SOLVERS", "MixGRPO", "MixWindows"]

MIX_STRATEGIES = ("progressive", "random", "decay", "exp_decay")
MIX_TAIL_SOLVERS = ("euler", "dpmsolver++")


class MixWindows:
    """The window of each iteration: ``window(i, gen) -> (start, stop, iteration in its group)``; the steps
    ``range(start, stop)`` are the SDE (and trained) steps, possibly none near the end (module docstring)."""

    def __init__(self, g: Any) -> None:
        self.size, self.strategy, self.iters = g.mix.window_size, g.mix.strategy, g.mix.iters_per_group
        self.max = g.num_steps - 2  # the reference's max_timesteps: the last step is never trained
        self.stride = g.mix.prog_overlap_step if g.mix.prog_overlap else g.mix.window_size
        self.roll_back = g.mix.roll_back
        self.ipg_max, self.ipg_min = g.mix.max_iters_per_group, g.mix.min_iters_per_group
        self.threshold, self.k = g.mix.exp_decay_threshold, g.mix.exp_decay_k
        self._memo = (0, 0, 0)  # (iteration, start, iteration in group) last reached: a run asks in order

    def _iters_per_group(self, start: int) -> float:
        if self.strategy == "decay":  # linear from ipg_max at step 0 to ipg_min at max
            progress = start / self.max
            return max(self.ipg_min, int(self.ipg_max * (1 - progress) + self.ipg_min * progress))
        if self.strategy == "exp_decay":
            return math.ceil(self.iters * math.exp(-self.k * max(0, start - self.threshold)))
        return self.iters

    def _advance(self, start: int, in_group: int) -> tuple[int, int]:
        """One update of the state (``random`` draws elsewhere: its state is not replayed)."""
        in_group += 1
        if in_group >= self._iters_per_group(start):
            in_group, start = 0, start + self.stride
        if start > self.max:
            start, in_group = (0, 0) if self.roll_back else (self.max, in_group)
        return start, in_group

    def state(self, iteration: int) -> tuple[int, int]:
        """``(start, iteration in group)`` after ``iteration`` updates (progressive, decay, exp_decay)."""
        done, start, in_group = self._memo if iteration >= self._memo[0] else (0, 0, 0)
        for _ in range(iteration - done):
            start, in_group = self._advance(start, in_group)
        self._memo = (iteration, start, in_group)
        return start, in_group

    def window(self, iteration: int, gen: torch.Generator) -> tuple[int, int, int]:
        if self.strategy == "random":
            # every update draws a new start in [0, max - W]; iteration 0 trains the initial one (0)
            start = int(torch.randint(0, self.max - self.size + 1, (1,), generator=gen)) if iteration else 0
            in_group = 0
        else:
            start, in_group = self.state(iteration)
        return start, min(start + self.size, self.max), in_group


class MixGRPO(Algorithm):
    name = "mix_grpo"
    section = "mix"
    # its window is flowgrpo.mix.window_size, moved by mix.strategy
    ignores = ("window_size", "window_range", "per_sample_windows", "sde_steps", "timestep_fraction")
    schedule_kind = "linspace"  # the reference samples on shift(linspace(1, 0, N + 1)), timesteps int(1000 sigma)

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.windows = MixWindows(self.g)

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        require(
            g.sde_type == "sde",
            "flowgrpo.sde_type",
            g.sde_type,
            "mix_grpo's window takes Flow-GRPO's SDE step; fix: remove flowgrpo.sde_type (sde)",
        )
        require(
            g.num_steps >= 3,
            "flowgrpo.num_steps",
            g.num_steps,
            "mix_grpo trains steps before num_steps - 2 (the reference never trains the last two): at least 3",
        )
        require(
            g.mix.window_size >= 1, "flowgrpo.mix.window_size", g.mix.window_size, "at least 1 (the reference's 4)"
        )
        require(
            g.mix.strategy in MIX_STRATEGIES,
            "flowgrpo.mix.strategy",
            g.mix.strategy,
            f"choose one of {MIX_STRATEGIES}",
        )
        require(g.mix.iters_per_group >= 1, "flowgrpo.mix.iters_per_group", g.mix.iters_per_group, "at least 1")
        require(g.mix.prog_overlap_step >= 0, "flowgrpo.mix.prog_overlap_step", g.mix.prog_overlap_step, "at least 0")
        require(  # one rule for every strategy: a larger window would be cut to the steps, quietly
            g.mix.window_size <= g.num_steps - 2,
            "flowgrpo.mix.window_size",
            g.mix.window_size,
            f"the window lies within the trained steps 0..num_steps - 3 (the reference never trains the last two); "
            f"fix: at most num_steps - 2 = {g.num_steps - 2}, or more flowgrpo.num_steps",
        )
        if g.mix.strategy == "decay":
            require(
                1 <= g.mix.min_iters_per_group <= g.mix.max_iters_per_group,
                "flowgrpo.mix.min_iters_per_group",
                g.mix.min_iters_per_group,
                f"decay needs 1 <= mix.min_iters_per_group <= mix.max_iters_per_group={g.mix.max_iters_per_group}",
            )
        if g.mix.strategy == "exp_decay":
            require(
                math.isfinite(g.mix.exp_decay_k) and g.mix.exp_decay_k >= 0,
                "flowgrpo.mix.exp_decay_k",
                g.mix.exp_decay_k,
                "a finite number >= 0 (the reference's 0.1)",
            )
        require(
            g.mix.tail_solver in MIX_TAIL_SOLVERS,
            "flowgrpo.mix.tail_solver",
            g.mix.tail_solver,
            f"choose one of {MIX_TAIL_SOLVERS}",
        )
        require(
            0 < g.mix.tail_compress_ratio <= 1,
            "flowgrpo.mix.tail_compress_ratio",
            g.mix.tail_compress_ratio,
            "in (0, 1] (the reference's 0.4; MixGRPO-Flash*: 0.2)",
        )
        require(
            g.mix.dpm_solver_type in DPM_SOLVER_TYPES,
            "flowgrpo.mix.dpm_solver_type",
            g.mix.dpm_solver_type,
            f"choose one of {DPM_SOLVER_TYPES}",
        )
        require(
            math.isfinite(g.mix.kl_coef) and g.mix.kl_coef >= 0,
            "flowgrpo.mix.kl_coef",
            g.mix.kl_coef,
            "a finite number >= 0 (0: no KL term)",
        )
        require(
            g.kl_coef == 0,
            "flowgrpo.kl_coef",
            g.kl_coef,
            "mix_grpo's KL is to the rollout's log-probs (flowgrpo.mix.kl_coef), not to the adapters-off "
            "reference; fix: flowgrpo.kl_coef=0",
        )
        linspace = g.schedule in ("auto", "linspace")
        if linspace:
            require(
                g.shift > 0,
                "flowgrpo.shift",
                g.shift,
                "mix_grpo samples on the shifted linspace (flowgrpo.schedule auto), which needs a shift; "
                "fix: flowgrpo.shift=3 (the reference's FLUX script)",
            )
        if g.mix.tail_solver == "dpmsolver++":
            require(
                linspace,
                "flowgrpo.schedule",
                g.schedule,
                "mix.tail_solver=dpmsolver++ compresses the tail of the shifted linspace, as the reference does; "
                "fix: flowgrpo.schedule=auto (or linspace), or flowgrpo.mix.tail_solver=euler",
            )

    # ------------------------------------------------------------------------------------------- batch
    def plan(self, batch: IterationBatch, gen: torch.Generator, iteration: int, shared: torch.Generator) -> None:
        if self.g.mix.same_noise:  # every sample of a prompt group starts from its first sample's noise
            first: dict[int, int] = {}
            index = [first.setdefault(int(gid), i) for i, gid in enumerate(batch.group_ids.tolist())]
            batch.latents = batch.latents[torch.tensor(index)]
        # the window moves with training: drawn from the iteration alone, the same on every rank
        start, stop, in_group = self.windows.window(iteration, shared)
        batch.plan.window_start, batch.plan.window_size, batch.plan.in_group = start, stop - start, in_group

    def span(self, plan: StepPlan, schedule: Any) -> Span:
        start, size = plan.window_start, int(plan.window_size or 0)
        tail = None
        if self.g.mix.tail_solver != "euler" and size:  # an empty window has no last step (the reference fails there)
            g = self.g
            tail = compressed_tail(g.num_steps, g.shift, start + size - 1, g.mix.tail_compress_ratio, g.mix.dpm_solver_type)
        return Span(start, size, self.step_rule(), tail=tail)

    def iteration_metrics(self, plan: StepPlan) -> dict[str, float]:
        # the reference's names (its wandb keys); its values there are the state after the update, ours the
        # window this iteration trained
        return {
            "cur_timesteps": float(plan.window_start),
            "cur_iter_in_group": float(plan.in_group),
            "window_size": float(plan.window_size or 0),
        }

    # -------------------------------------------------------------------------------------- advantages
    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return group_advantages(
            rewards, groups, std="group", eps=1e-8, clip=self.g.adv_clip_max, correction=1
        )

    # ------------------------------------------------------------------------------------------ update
    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy loss of a window step, plus ``mix.kl_coef * 0.5 mean((lp - lp_old)^2)`` (the
        reference's ``kl_loss``, metric ``kl_loss``), both ``/ normalizer``."""
        g = self.g
        assert step.log_prob is not None and targets.old_log_prob is not None
        old = targets.old_log_prob
        loss, metrics = flowgrpo_loss(
            step.log_prob, old, targets.advantages, clip_range=g.clip_range, normalizer=normalizer
        )
        lp = step.log_prob.to(torch.promote_types(step.log_prob.dtype, torch.float32))
        kl = 0.5 * (lp - old.detach().to(lp.dtype)).square().mean()
        if g.mix.kl_coef > 0:
            loss = loss + g.mix.kl_coef * kl / normalizer
        metrics["kl_loss"] = kl.detach()
        metrics["loss"] = metrics["loss"] + g.mix.kl_coef * kl.detach()
        return loss, metrics
