"""Flow-DPPO (verl-omni ``trainer/diffusion/diffusion_algos.py`` ``FlowDPPOLoss``): the Flow-GRPO rollout and
advantages, with PPO's ratio clip replaced by a trust region on the exact divergence of one SDE step.

One SDE step's policy is Gaussian, ``N(mu, s^2)`` with ``s = std_dev_t sqrt(-dt)``; the KL between the policy and the
old policy at a stored step is ``D_i = mean_elems((mu_theta_i - mu_old_i)^2) / (2 s_i^2)``. A sample whose update
went past the region (``D_i >= threshold``) *and* moves further away (``rho_i > 1`` with ``A_i > 0``, or
``rho_i < 1`` with ``A_i < 0``) contributes nothing; every other sample contributes the unclipped ``-A_i rho_i``:

    rho_i = exp(log p_theta_i - log p_old_i)
    L     = mean_i (0 if masked_i else -A_i rho_i)        (masked samples count as zeros in the mean)

The mask is a constant (no gradient through ``D_i``). ``flowgrpo.dppo.kl_coefficient: false`` drops ``2 s^2``'s ``s^2``
(verl-omni's ``add_kl_coefficient``: ``D_i = mean((mu - mu_old)^2) / 2``). ``mu_old`` is the old policy's step mean,
stored beside its log-prob (``Inputs.old_means``). The optional ``flowgrpo.kl_coef`` adds flow_grpo's KL to the
adapters-off reference, as the other losses do.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, TrainConfig
from .base import Inputs, StepInputs, Targets
from .flow_grpo import FlowGRPO
from .loss import kl_to_reference, ratio_metrics

__all__ = ["FlowDPPO", "flow_dppo_loss"]


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    *,
    threshold: float,
    kl_coefficient: bool = True,
    normalizer: float = 1.0,
    kl_coef: float = 0.0,
    ref_prev_sample_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's loss of one trained step (module docstring) and its metrics.

    Args:
        log_prob, old_log_prob, advantages: ``[B]``; the old log-prob and the advantages are constants.
        prev_sample_mean, old_prev_sample_mean: ``[B, ...]`` the policy's and the old policy's step means.
        std_dev_t, sqrt_dt: ``[B]`` the step's ``std_dev_t`` and ``sqrt(-dt)`` (constants).
        threshold: the trust region's divergence (verl-omni's ``kl_mask_threshold``, 1e-5).
        kl_coefficient: divide by ``s^2`` (verl-omni's ``add_kl_coefficient``, true).
        normalizer: divides the loss (micro-batches x trained steps).

    Returns:
        ``(loss, metrics)``: ``loss``, ``policy_loss``, ``kl``, ``ppo_kl``, ``approx_kl``, ``ratio_mean``,
        ``ratio_std``, ``clipfrac`` (the masked fraction, what a clip would have removed), ``kl_new_old_mean``,
        ``kl_new_old_max``, ``kl_mask_fraction`` (``D_i`` past the threshold), ``pos_rm_fraction``,
        ``neg_rm_fraction``.
    """
    if not (prev_sample_mean.shape == old_prev_sample_mean.shape and prev_sample_mean.shape[0] == log_prob.shape[0]):
        raise ValueError(
            f"flow_dppo_loss: prev_sample_mean {tuple(prev_sample_mean.shape)} and old_prev_sample_mean "
            f"{tuple(old_prev_sample_mean.shape)} must be the same [B, ...] with B = {log_prob.shape[0]}"
        )
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    lp, old = log_prob.to(dtype), old_log_prob.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        drift = (prev_sample_mean.detach().to(dtype) - old_prev_sample_mean.detach().to(dtype)) ** 2
        if kl_coefficient:
            s = std_dev_t.detach().to(dtype) * sqrt_dt.detach().to(dtype)
            drift = drift / (2.0 * s.reshape(-1, *[1] * (drift.ndim - 1)) ** 2)
        else:
            drift = drift / 2.0
        divergence = drift.mean(dim=tuple(range(1, drift.ndim)))
        outside = divergence >= threshold
        further_up = outside & (ratio > 1.0) & (adv > 0)
        further_down = outside & (ratio < 1.0) & (adv < 0)
        keep = ~(further_up | further_down)
    pg = torch.where(keep, -adv * ratio, torch.zeros((), dtype=dtype, device=ratio.device)).mean()
    kl = kl_to_reference(kl_coef, prev_sample_mean, ref_prev_sample_mean, std_dev_t, dtype, pg, "flow_dppo_loss")
    total = pg + kl_coef * kl
    metrics = ratio_metrics(total, pg, kl, log_ratio, ratio)
    with torch.no_grad():
        metrics.update(
            approx_kl=0.5 * (log_ratio.detach() ** 2).mean(),
            clipfrac=(~keep).to(dtype).mean(),
            kl_new_old_mean=divergence.mean(),
            kl_new_old_max=divergence.max(),
            kl_mask_fraction=outside.to(dtype).mean(),
            pos_rm_fraction=further_up.to(dtype).mean(),
            neg_rm_fraction=further_down.to(dtype).mean(),
        )
    return total / normalizer, metrics


class FlowDPPO(FlowGRPO):
    name = "flow_dppo"
    section = "dppo"

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        if g.sde_type != "sde":
            raise ConfigError(
                f"flowgrpo.sde_type={g.sde_type!r}: Flow-DPPO's divergence is the Gaussian SDE step's (std_dev_t "
                "sqrt(-dt)); fix: flowgrpo.sde_type=sde"
            )
        if not g.dppo.kl_mask_threshold > 0:
            raise ConfigError(
                f"flowgrpo.dppo.kl_mask_threshold={g.dppo.kl_mask_threshold!r} must be > 0 (verl-omni's 1e-5)"
            )
        super().check(config)

    def inputs(self) -> Inputs:
        """The old policy's step means beside its log-probs: the divergence reads them."""
        return Inputs(old_means=True, reference=self.g.kl_coef > 0)

    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert step.log_prob is not None and step.std_dev_t is not None and step.sqrt_dt is not None
        assert step.prev_sample_mean is not None and targets.old_log_prob is not None
        assert targets.old_prev_sample_mean is not None
        return flow_dppo_loss(
            step.log_prob,
            targets.old_log_prob,
            targets.advantages,
            step.prev_sample_mean,
            targets.old_prev_sample_mean,
            step.std_dev_t,
            step.sqrt_dt,
            threshold=self.g.dppo.kl_mask_threshold,
            kl_coefficient=self.g.dppo.kl_coefficient,
            normalizer=normalizer,
            kl_coef=self.g.kl_coef,
            ref_prev_sample_mean=step.ref_prev_sample_mean,
        )
