"""GARDO (the authors' tinnerhrhe/GARDO; flow_grpo ``scripts/train_sd3_gardo.py``, ``config/grpo_gardo.py``): the
Flow-GRPO rollout (every step an SDE step) with three changes against reward hacking.

- **Diversity-aware advantages.** Each sample's advantage is its main reward minus its prompt group's mean, with no
  std division. A sample at or above the mean is weighted by its novelty: ``d_i = min_{j != i} (1 - cos(f_i, f_j))``
  over the other samples of its group, in an image model's feature space (DINO), divided by the group's mean ``d``;
  a sample below the mean keeps weight 1.
- **A gated KL.** The KL to the reference applies only to the samples the main reward is least trusted on: each
  sample's uncertainty is its rank under the main reward minus its mean rank under the auxiliary rewards (ranks over
  the whole batch, 1 the highest). Of the samples with ``u >= 0``, those above the ``1 - fraction`` quantile are
  gated. The fraction starts at 0.1 and moves within [0.02, 0.2]: up by 10% when this iteration's mean
  uncertainty passes the highest of the last 20, down by 10% when it is below the lowest (:class:`KLFraction`).
- **A resetting reference.** The reference is a copy of the policy. It is copied again after an iteration whose mean
  KL passes ``reset_kl``, and once more than ``reset_every`` iterations passed since the last copy.

The policy loss is flow_grpo's clipped ratio, each sample's term weighted by its step's noise std over the
micro-batch's mean std (``std_weighting``). The KL is flow_grpo's, ``(mu - mu_ref)^2 / (2 std_dev_t^2)``, averaged
over the gated samples' elements (0 where the micro-batch has none):

    L = mean_i (s_i / mean(s)) max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)) + beta mean_{i gated} KL_i

Differences from the reference, each for a reason:

- A group of one sample, or whose features are all equal (mean ``d`` = 0), keeps weight 1 where the reference divides
  by zero (or takes the min of nothing).
- The reset reads the iteration's mean KL over its data-parallel ranks; the reference reads each optimizer step's.
  They are equal with one optimizer step per iteration (``flowgrpo.mini_batches: 1``).
- The reference is a frozen copy of the whole model (``old_policy.OldPolicy``), LoRA or not; the reference code keeps a
  second LoRA adapter. A resumed run copies the loaded weights: resuming is a reset.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..config import ConfigError, TrainConfig
from .base import Inputs, RewardTable, StepInputs, Targets
from .flow_grpo import FlowGRPO
from .loss import ratio_metrics
from .old_policy import OldPolicy

__all__ = ["GARDO", "KLFraction", "diversity_weights", "gardo_advantages", "gardo_loss", "gated_rows", "uncertainty"]


def diversity_weights(features: torch.Tensor, groups: torch.Tensor, centered: torch.Tensor) -> torch.Tensor:
    """``[N]`` weights: ``d_i / mean_group(d)`` where ``centered_i >= 0``, else 1; ``d_i`` the cosine distance from
    sample i's features ``[N, D]`` to the nearest other sample of its group. A group of one, or one whose mean ``d``
    is 0, keeps 1."""
    f = torch.nan_to_num(features.to(torch.float64))
    f = f / f.norm(dim=1, keepdim=True)
    weights = torch.ones_like(centered, dtype=torch.float64)
    for g in torch.unique(groups):
        rows = torch.nonzero(groups == g).flatten()
        if rows.numel() < 2:
            continue
        fg = f[rows]
        distance = 1.0 - (fg @ fg.T).clamp(-1.0, 1.0)
        distance.fill_diagonal_(math.inf)
        nearest = distance.min(dim=1).values
        scale = nearest.mean()
        if not scale > 0:
            continue
        weights[rows] = torch.where(centered[rows] >= 0, nearest / scale, weights[rows])
    return weights


def gardo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, features: torch.Tensor | None, clip: float
) -> torch.Tensor:
    """``[N]``: ``(r - mean of its group)`` times :func:`diversity_weights` (1 without ``features``), clamped to
    ``[-clip, clip]`` (flow_grpo clamps them in its loss); float64. A constant group gets exactly 0."""
    r = rewards.detach().to(torch.float64)
    _, inverse = torch.unique(groups, return_inverse=True)
    count = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    centered = r - mean[inverse]
    lo = torch.full_like(count, math.inf).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full_like(count, -math.inf).scatter_reduce(0, inverse, r, "amax")
    centered = torch.where((lo == hi)[inverse], torch.zeros_like(centered), centered)
    if features is not None:
        centered = centered * diversity_weights(features, groups, centered)
    return centered.clamp(-clip, clip)


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """``[N]`` each score's rank, 1 the highest (ties in index order)."""
    order = torch.sort(scores.to(torch.float64), descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, scores.numel() + 1)
    return ranks.to(torch.float64)


def uncertainty(main: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N]``: the main reward's rank minus the auxiliary rewards' mean rank (over the whole batch)."""
    return _ranks(main) - torch.stack([_ranks(a) for a in aux]).mean(dim=0)


class KLFraction:
    """The fraction of samples the KL applies to (the reference's ``RiskCompensator``): moved by ``rate`` when an
    iteration's mean uncertainty leaves the range of the last ``window`` iterations', kept within ``[low, high]``."""

    def __init__(self, start: float, low: float, high: float, rate: float, window: int) -> None:
        self.start, self.low, self.high, self.rate, self.window = start, low, high, rate, window
        self.fraction = start
        self.history: list[float] = []

    def update(self, scores: torch.Tensor) -> float:
        """Move the fraction by this iteration's ``scores`` (the uncertainties >= 0); the new fraction."""
        level = float(scores.to(torch.float64).mean())
        if not self.history:
            self.fraction = self.start
        elif level > max(self.history):
            self.fraction *= 1.0 + self.rate
        elif level < min(self.history):
            self.fraction *= 1.0 - self.rate
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = [*self.history, level][-self.window :]
        return self.fraction

    def state(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "history": list(self.history)}

    def load(self, state: dict[str, Any]) -> None:
        self.fraction, self.history = float(state["fraction"]), [float(x) for x in state["history"]]


def gated_rows(u: torch.Tensor, fraction: float) -> torch.Tensor:
    """``[N]`` bool: ``u`` above the ``1 - fraction`` quantile (linear, as ``numpy.percentile``) of its values >= 0."""
    level = torch.quantile(u[u >= 0].to(torch.float64), 1.0 - fraction)
    return u > level


def gardo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    std_dev_t: torch.Tensor,
    *,
    clip_range: float,
    std_weighting: bool = True,
    kl_coef: float = 0.0,
    gate: torch.Tensor | None = None,
    prev_sample_mean: torch.Tensor | None = None,
    ref_prev_sample_mean: torch.Tensor | None = None,
    normalizer: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GARDO's loss of one trained step (module docstring) and its metrics.

    Args:
        log_prob, old_log_prob, advantages, std_dev_t: ``[B]`` (all but ``log_prob`` constants).
        clip_range: PPO's ``eps``.
        std_weighting: weight each sample's term by ``std_dev_t / mean(std_dev_t)``.
        kl_coef: ``beta`` of the gated KL; with ``gate`` ``[B]`` bool, ``prev_sample_mean`` and
            ``ref_prev_sample_mean`` ``[B, ...]``.
        normalizer: divides the loss (micro-batches x trained steps).

    Returns:
        ``(loss, metrics)``: ``loss``, ``policy_loss``, ``kl``, ``ppo_kl``, ``ratio_mean``, ``ratio_std``, ``clipfrac``,
        ``kl_gated_fraction``.
    """
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    lp, old = log_prob.to(dtype), old_log_prob.detach().to(dtype)
    adv, std = advantages.detach().to(dtype), std_dev_t.detach().to(dtype)
    ratio = torch.exp(lp - old)
    rows = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    if std_weighting:
        rows = std / std.mean() * rows
    pg = rows.mean()
    kl = pg.new_zeros(())
    gated = torch.zeros_like(adv) if gate is None else gate.to(dtype)
    if kl_coef > 0 and gate is not None:
        if prev_sample_mean is None or ref_prev_sample_mean is None:
            raise ValueError("gardo_loss: kl_coef > 0 needs prev_sample_mean and ref_prev_sample_mean")
        sq = (prev_sample_mean.to(dtype) - ref_prev_sample_mean.detach().to(dtype)) ** 2
        per_row = sq.mean(dim=tuple(range(1, sq.ndim))) / (2.0 * std**2)
        # the mean over the gated rows, 0 where none is (no host read: the count is clamped to 1)
        kl = (per_row * gated).sum() / gated.sum().clamp_min(1.0)
    total = pg + kl_coef * kl
    metrics = ratio_metrics(total, pg, kl, lp - old, ratio)
    metrics["clipfrac"] = ((ratio.detach() - 1.0).abs() > clip_range).to(dtype).mean()
    metrics["kl_gated_fraction"] = gated.mean()
    return total / normalizer, metrics


class GARDO(FlowGRPO):
    name = "gardo"
    section = "gardo"
    default_sde_steps = "all"
    default_timestep_fraction = 0.89  # the SD3 OCR and GenEval recipes (FLUX: 0.7)
    ignores = ("kl_coef", "kl_reward")  # its KL is flowgrpo.gardo.kl_coef's, on the gated samples
    takes_kl_reward: ClassVar[bool] = False
    trains_lagged: ClassVar[bool] = False  # its reference resets and KL gate follow the iterations' rollouts

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        c = self.g.gardo
        low, high = c.kl_fraction_range
        self.fraction = KLFraction(c.kl_fraction, low, high, c.kl_fraction_rate, c.kl_window)
        self.reference: OldPolicy | None = None
        self.iteration = 0  # iterations trained (the reference's epoch)
        self.last_reset = 0
        self.reset_pending = False

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        super().check(config)
        g, c = config.flowgrpo, config.flowgrpo.gardo
        if not c.features:
            raise ConfigError(
                "flowgrpo.gardo.features is empty: GARDO weighs the above-mean samples by their distance to the "
                "nearest other sample of their prompt in an image model's feature space; fix: the folder of a DINOv2 "
                "or DINOv3 model (transformers save_pretrained, e.g. a downloaded facebook/dinov2-base), `latents` "
                "(the final latents as features, no model), or `none` (no diversity weight)"
            )
        if c.features not in ("latents", "none") and not (Path(c.features) / "config.json").is_file():
            raise ConfigError(
                f"flowgrpo.gardo.features={c.features!r} is not a model folder (no config.json); fix: a folder written "
                "by save_pretrained of a DINOv2 / DINOv3 model (e.g. a downloaded facebook/dinov2-base), `latents` or "
                "`none`"
            )
        from ..rewards.loading import reward_specs

        names = [s.name for s in reward_specs(g.rewards, g.reward)]
        for key, wanted in (("main_reward", [c.main_reward] if c.main_reward else []), ("aux_rewards", c.aux_rewards)):
            unknown = [n for n in wanted if n not in names]
            if unknown:
                raise ConfigError(
                    f"flowgrpo.gardo.{key}: {unknown} is not a configured reward (flowgrpo.rewards names: {names}); "
                    "fix: a reward's name (its `name:` key, else its function's name)"
                )
        if c.aux_rewards and c.main_reward in c.aux_rewards:
            raise ConfigError(
                f"flowgrpo.gardo.aux_rewards={c.aux_rewards} holds the main reward {c.main_reward!r}: its rank would "
                "be held against itself; fix: the other rewards"
            )
        low_high = c.kl_fraction_range
        if not (
            isinstance(low_high, list)
            and len(low_high) == 2
            and 0 < low_high[0] <= c.kl_fraction <= low_high[1] <= 1
        ):
            raise ConfigError(
                f"flowgrpo.gardo.kl_fraction={c.kl_fraction} and kl_fraction_range={low_high} must satisfy 0 < low <= "
                "kl_fraction <= high <= 1 (the reference: 0.1 in [0.02, 0.2])"
            )
        for key in ("kl_coef", "reset_kl", "kl_fraction_rate"):
            value = getattr(c, key)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"flowgrpo.gardo.{key}={value!r} must be a finite number >= 0")
        for key in ("kl_window", "reset_every"):
            value = getattr(c, key)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"flowgrpo.gardo.{key}={value!r} must be an integer >= 1")
        if g.sde_type == "cps" and c.kl_coef > 0:
            raise ConfigError(
                f"flowgrpo.sde_type=cps with flowgrpo.gardo.kl_coef={c.kl_coef}: GARDO's KL divides by the step's "
                "noise std, which CPS's last step does not have; fix: flowgrpo.sde_type=sde (the reference's)"
            )

    # ---------------------------------------------------------------------------------------- features
    def image_features(self) -> str | None:
        c = self.g.gardo.features
        return None if c == "none" else c

    # ---------------------------------------------------------------------------------------- lifecycle
    def attach(self, engine: Any) -> None:
        """The reference: a frozen copy of the weights (built once; after a checkpoint is loaded, copied from it)."""
        if engine.num_experts > 1:
            raise ConfigError(
                "flowgrpo.algorithm=gardo keeps a copy of one model as its reference, and this model has two experts; "
                "fix: another flowgrpo.algorithm for this model"
            )
        if self.g.gardo.kl_coef == 0:
            return
        if self.reference is None:
            self.reference = OldPolicy(engine)
        else:
            self.reference.copy()
        self.last_reset, self.reset_pending = self.iteration, False

    @contextlib.contextmanager
    def reference_policy(self, engine: Any) -> Iterator[Any]:
        assert self.reference is not None, "GARDO.attach builds the reference"
        yield self.reference.engine

    def after_update(self, engine: Any, metrics: dict[str, float]) -> dict[str, float]:
        """Copy the policy into the reference where this iteration's KL (the mean over data-parallel ranks) passed
        ``reset_kl`` or more than ``reset_every`` iterations passed since the last copy."""
        c = self.g.gardo
        self.iteration += 1
        out = {"kl_fraction": self.fraction.fraction}
        if self.reference is None:
            return out
        kl = engine.gather_dp(torch.tensor([metrics.get("kl", 0.0)], dtype=torch.float64, device=engine.device))
        self.reset_pending = self.reset_pending or bool(kl.mean() > c.reset_kl)
        reset = self.reset_pending or self.iteration - self.last_reset > c.reset_every
        if reset:
            self.reference.copy()
            self.last_reset, self.reset_pending = self.iteration, False
        out["reference_reset"] = float(reset)
        return out

    def state(self) -> dict[str, Any]:
        return {"fraction": self.fraction.state(), "iteration": self.iteration}

    def load_state(self, state: dict[str, Any]) -> None:
        if state:
            self.fraction.load(state["fraction"])
            self.iteration = int(state["iteration"])

    # -------------------------------------------------------------------------------------- advantages
    def advantages_of(self, table: RewardTable) -> torch.Tensor:
        c = self.g.gardo
        main = table.each[c.main_reward] if c.main_reward else table.total
        features = None
        if self.image_features() is not None:
            if table.features is None:
                raise ConfigError(
                    "flowgrpo.gardo.features is set, and this run's rewards came without image features (a reward "
                    "given to the trainer in code replaces the configured scoring); fix: the configured rewards, or "
                    "flowgrpo.gardo.features=none"
                )
            features = table.features
        adv = gardo_advantages(main, table.groups, features, self.g.adv_clip_max)
        return adv.to(main.dtype if main.is_floating_point() else torch.float32)

    def kl_rows(self, table: RewardTable) -> torch.Tensor | None:
        """The samples the KL applies to (:func:`gated_rows`; the fraction moved first); none without auxiliary
        rewards."""
        c = self.g.gardo
        if not c.aux_rewards:
            return torch.zeros(table.total.shape[0], dtype=torch.bool, device=table.total.device)
        main = table.each[c.main_reward] if c.main_reward else table.total
        u = uncertainty(main.cpu(), [table.each[n].cpu() for n in c.aux_rewards])
        fraction = self.fraction.update(u[u >= 0])
        return gated_rows(u, fraction).to(table.total.device)

    # ------------------------------------------------------------------------------------------ update
    def inputs(self) -> Inputs:
        return Inputs(reference=self.g.gardo.kl_coef > 0)

    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.g.gardo
        assert step.log_prob is not None and step.std_dev_t is not None and targets.old_log_prob is not None
        return gardo_loss(
            step.log_prob,
            targets.old_log_prob,
            targets.advantages,
            step.std_dev_t,
            clip_range=self.g.clip_range,
            std_weighting=c.std_weighting,
            kl_coef=c.kl_coef,
            gate=targets.kl_rows,
            prev_sample_mean=step.prev_sample_mean,
            ref_prev_sample_mean=step.ref_prev_sample_mean,
            normalizer=normalizer,
        )
