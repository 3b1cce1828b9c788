"""GRPO-Guard (arXiv 2510.22319; flow_grpo ``scripts/train_sd3_GRPO_Guard.py``, verl-omni ``GRPOGuardLoss``): Flow-GRPO
with the importance ratio normalised per trained step ("RatioNorm") and the loss reweighted across timesteps.

With one SDE step's Gaussian policy ``N(mu, s^2)``, ``s = std_dev_t sqrt(-dt)``, the log-ratio of a stored sample
``x'`` is ``(|x' - mu_old|^2 - |x' - mu|^2) / (2 s^2)`` (per element, averaged): its mean under the old policy is
``-|mu - mu_old|^2 / (2 s^2)``, negative and growing as ``1 / s^2`` towards the low-noise steps, so the plain ratio
leans below 1 there and PPO's clip acts one-sidedly. GRPO-Guard adds that drift back and rescales by ``S``:

    S     = mean_b(std_dev_t) * mean_b(sqrt(-dt))                         (one scalar per trained step)
    b_i   = mean_elems((mu_theta_i - mu_old_i)^2) / (2 S^2)              ("ratio mean bias")
    rho_i = exp((log p_theta_i - log p_old_i + b_i) * S)
    L     = mean_i max(-A_i rho_i, -A_i clip(rho_i, 1 - eps, 1 + eps)) / mean_b(sqrt(-dt))^2

(means over the micro-batch, as both references take them). ``flowgrpo.guard.bias: batch`` uses the micro-batch
mean of ``b_i`` for every sample, which is what flow_grpo's script computes (its ``.mean(dim=())`` over a ``[B]``
tensor reduces every dim); ``sample`` (the default) keeps one ``b_i`` per sample, as verl-omni and the paper's
formula. ``flowgrpo.guard.ratio_norm: false`` is flow_grpo's ``rationorm=False``: the plain ratio and no reweighting.

``mu_old`` is the old policy's step mean, stored beside the old log-prob (``Algorithm.keeps_old_means``): recomputed
by the actor (``recompute_old_log_probs``, as verl-omni) or kept by the rollout (as flow_grpo). The rollout is
flow_grpo's ``all`` (every step SDE, the first ``int(N * timestep_fraction)`` = 0.99 N steps trained) unless
``flowgrpo.sde_steps`` says ``window``. Advantages: each prompt group's population std + 1e-4 (the reference config's
``global_std = False``), clamped to ``adv_clip_max``.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, TrainConfig
from .advantages import group_advantages
from .base import Inputs, StepInputs, Targets
from .flow_grpo import FlowGRPO
from .loss import kl_to_reference, ratio_metrics

__all__ = ["GUARD_BIAS", "GRPOGuard", "grpo_guard_loss"]

GUARD_BIAS = ("sample", "batch")


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    *,
    clip_range: float,
    normalizer: float = 1.0,
    bias: str = "sample",
    kl_coef: float = 0.0,
    ref_prev_sample_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard's loss of one trained step (module docstring) and its metrics.

    Args:
        log_prob, old_log_prob, advantages: ``[B]``, as :func:`~.loss.flowgrpo_loss` takes them.
        prev_sample_mean: ``[B, ...]`` the policy's step mean (carries the gradient: ``b_i`` does too).
        old_prev_sample_mean: ``[B, ...]`` the old policy's step mean (a constant).
        std_dev_t, sqrt_dt: ``[B]`` the step's ``std_dev_t`` and ``sqrt(-dt)`` (constants).
        clip_range: PPO's ``eps`` (GRPO-Guard's configs: 2e-6, 4e-6 for PickScore).
        normalizer: divides the loss (micro-batches x trained steps).
        bias: ``sample`` (one ``b_i`` per sample) or ``batch`` (their mean, flow_grpo's script).
        kl_coef, ref_prev_sample_mean: the optional KL to the reference, flow_grpo's (``std_dev_t``, no ``dt``).

    Returns:
        ``(loss, metrics)``: ``loss``, ``policy_loss``, ``kl``, ``ppo_kl`` (``mean(-(log p - log p_old))``, the
        unnormalised log-ratio as verl-omni reports it), ``approx_kl`` (flow_grpo's ``0.5 mean(log-ratio^2)``),
        ``clipfrac``, ``clipfrac_gt_one``, ``clipfrac_lt_one`` (flow_grpo's names), ``ratio_mean``, ``ratio_std``
        (of the normalised ratio, population), ``ratio_mean_bias`` (``mean b_i``).
    """
    if bias not in GUARD_BIAS:
        raise ValueError(f"grpo_guard_loss: bias={bias!r}; choose one of {GUARD_BIAS}")
    if not (prev_sample_mean.shape == old_prev_sample_mean.shape and prev_sample_mean.shape[0] == log_prob.shape[0]):
        raise ValueError(
            f"grpo_guard_loss: prev_sample_mean {tuple(prev_sample_mean.shape)} and old_prev_sample_mean "
            f"{tuple(old_prev_sample_mean.shape)} must be the same [B, ...] with B = {log_prob.shape[0]}; pass the "
            "policy's and the old policy's step means of the same samples"
        )
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    lp, old = log_prob.to(dtype), old_log_prob.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    sqrt_dt_mean = sqrt_dt.detach().to(dtype).mean()
    scale = std_dev_t.detach().to(dtype).mean() * sqrt_dt_mean
    drift = (prev_sample_mean.to(dtype) - old_prev_sample_mean.detach().to(dtype)) ** 2
    drift = drift.mean(dim=tuple(range(1, drift.ndim)))
    if bias == "batch":
        drift = drift.mean().expand_as(drift)
    mean_bias = drift / (2.0 * scale**2)
    log_ratio = lp - old
    ratio = torch.exp((log_ratio + mean_bias) * scale)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg = torch.maximum(unclipped, clipped).mean() / sqrt_dt_mean**2
    kl = kl_to_reference(kl_coef, prev_sample_mean, ref_prev_sample_mean, std_dev_t, dtype, pg, "grpo_guard_loss")
    total = pg + kl_coef * kl
    metrics = ratio_metrics(total, pg, kl, log_ratio, ratio)
    with torch.no_grad():
        r = ratio.detach()
        metrics.update(
            approx_kl=0.5 * (log_ratio.detach() ** 2).mean(),
            clipfrac=((r - 1.0).abs() > clip_range).to(dtype).mean(),
            clipfrac_gt_one=(r - 1.0 > clip_range).to(dtype).mean(),
            clipfrac_lt_one=(1.0 - r > clip_range).to(dtype).mean(),
            ratio_mean_bias=mean_bias.detach().mean(),
        )
    return total / normalizer, metrics


class GRPOGuard(FlowGRPO):
    name = "grpo_guard"
    section = "guard"
    default_sde_steps = "all"  # flow_grpo's GRPO-Guard script samples every step with noise

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        if g.sde_type != "sde":
            raise ConfigError(
                f"flowgrpo.sde_type={g.sde_type!r}: GRPO-Guard normalises the ratio of flow_grpo's Gaussian SDE step "
                "(std_dev_t sqrt(-dt)); fix: flowgrpo.sde_type=sde"
            )
        if g.guard.bias not in GUARD_BIAS:
            raise ConfigError(
                f"flowgrpo.guard.bias={g.guard.bias!r}: choose 'sample' (one bias per sample, verl-omni) or 'batch' "
                "(the micro-batch mean, flow_grpo's script)"
            )
        super().check(config)

    def inputs(self) -> Inputs:
        """The old policy's step means beside its log-probs (RatioNorm's mean-drift bias reads them)."""
        return Inputs(old_means=self.g.guard.ratio_norm, reference=self.g.kl_coef > 0)

    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """flow_grpo's per-prompt stat tracker with ``global_std = False``: the group's population std + 1e-4."""
        return group_advantages(rewards, groups, std="group", eps=1e-4, clip=self.g.adv_clip_max, correction=0)

    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The GRPO-Guard loss of one trained step (``guard.ratio_norm: false``: Flow-GRPO's)."""
        if not self.g.guard.ratio_norm:
            return super().loss(step, targets, normalizer)
        assert step.log_prob is not None and step.std_dev_t is not None and step.sqrt_dt is not None
        return grpo_guard_loss(
            step.log_prob,
            targets.old_log_prob,
            targets.advantages,
            step.prev_sample_mean,
            targets.old_prev_sample_mean,
            step.std_dev_t,
            step.sqrt_dt,
            clip_range=self.g.clip_range,
            normalizer=normalizer,
            bias=self.g.guard.bias,
            kl_coef=self.g.kl_coef,
            ref_prev_sample_mean=step.ref_prev_sample_mean,
        )
