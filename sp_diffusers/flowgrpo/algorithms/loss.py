"""The Flow-GRPO objective for one SDE window step: PPO-clipped policy gradient plus an optional KL term."""

from __future__ import annotations

import torch

__all__ = ["flowgrpo_loss", "kl_to_reference", "ratio_metrics", "reference_kl"]


def _check_batch_vector(t: torch.Tensor, name: str, batch: int) -> None:
    if t.shape != (batch,):
        raise ValueError(
            f"flowgrpo_loss: {name} must have shape [B] = [{batch}] like log_prob, got {tuple(t.shape)}; "
            "pass one value per sample for this window step (e.g. old_log_probs[:, k])."
        )


def _kl_term(
    prev_sample_mean: torch.Tensor | None,
    ref_prev_sample_mean: torch.Tensor | None,
    std_dev_t: torch.Tensor | float | None,
    batch: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    missing = [
        name
        for name, value in (
            ("prev_sample_mean", prev_sample_mean),
            ("ref_prev_sample_mean", ref_prev_sample_mean),
            ("std_dev_t", std_dev_t),
        )
        if value is None
    ]
    if missing:
        raise ValueError(
            f"flowgrpo_loss: kl_coef > 0 needs prev_sample_mean, ref_prev_sample_mean and std_dev_t, missing "
            f"{', '.join(missing)}; pass them (SDEStep.prev_sample_mean / .std_dev_t of the policy and the "
            "reference model's prev_sample_mean) or set kl_coef=0."
        )
    assert prev_sample_mean is not None and ref_prev_sample_mean is not None and std_dev_t is not None
    if prev_sample_mean.ndim < 2 or prev_sample_mean.shape[0] != batch:
        raise ValueError(
            f"flowgrpo_loss: prev_sample_mean must have shape [B, ...] with B = {batch} and at least one "
            f"non-batch dim, got {tuple(prev_sample_mean.shape)}; pass SDEStep.prev_sample_mean."
        )
    if ref_prev_sample_mean.shape != prev_sample_mean.shape:
        raise ValueError(
            f"flowgrpo_loss: ref_prev_sample_mean shape {tuple(ref_prev_sample_mean.shape)} != prev_sample_mean "
            f"shape {tuple(prev_sample_mean.shape)}; run the reference model on the same latents and step."
        )
    std = torch.as_tensor(std_dev_t, device=prev_sample_mean.device).detach().to(dtype)
    if std.numel() == batch:
        std = std.reshape(batch)
    elif std.numel() != 1:
        raise ValueError(
            f"flowgrpo_loss: std_dev_t must be a scalar or hold one value per sample (B = {batch}), got shape "
            f"{tuple(std.shape)}; pass SDEStep.std_dev_t."
        )
    else:
        std = std.reshape(()).expand(batch)
    sq = (prev_sample_mean.to(dtype) - ref_prev_sample_mean.detach().to(dtype)) ** 2
    per_sample = sq.mean(dim=tuple(range(1, sq.ndim))) / (2.0 * std**2)
    return per_sample.mean()


def reference_kl(
    prev_sample_mean: torch.Tensor,
    ref_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The KL term of :func:`flowgrpo_loss` alone (0-d): ``mean_b(mean((mean - mean_ref)^2) / (2 std_dev_t_b^2))``."""
    return _kl_term(prev_sample_mean, ref_prev_sample_mean, std_dev_t, prev_sample_mean.shape[0], dtype)


def kl_to_reference(
    kl_coef: float,
    prev_sample_mean: torch.Tensor,
    ref_prev_sample_mean: torch.Tensor | None,
    std_dev_t: torch.Tensor,
    dtype: torch.dtype,
    like: torch.Tensor,
    loss: str,
) -> torch.Tensor:
    """The optional KL term of a ratio loss (``loss`` names it in the error): :func:`reference_kl` where
    ``kl_coef > 0``, else a 0-d zero like ``like``."""
    if not kl_coef > 0:
        return like.new_zeros(())
    if ref_prev_sample_mean is None:
        raise ValueError(f"{loss}: kl_coef > 0 needs ref_prev_sample_mean (the reference's step mean)")
    return reference_kl(prev_sample_mean, ref_prev_sample_mean, std_dev_t, dtype)


@torch.no_grad()
def ratio_metrics(
    total: torch.Tensor, pg: torch.Tensor, kl: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What every ratio loss reports (detached 0-d tensors): ``loss`` (before the normalizer), ``policy_loss``,
    ``kl``, ``ppo_kl`` (``mean(-log ratio)``), ``ratio_mean``, ``ratio_std`` (population)."""
    r = ratio.detach()
    return {
        "loss": total.detach(),
        "policy_loss": pg.detach(),
        "kl": kl.detach(),
        "ppo_kl": (-log_ratio.detach()).mean(),
        "ratio_mean": r.mean(),
        "ratio_std": r.std(correction=0),
    }


def flowgrpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    normalizer: float = 1.0,
    kl_coef: float = 0.0,
    prev_sample_mean: torch.Tensor | None = None,
    ref_prev_sample_mean: torch.Tensor | None = None,
    std_dev_t: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Flow-GRPO loss of one window step ``k`` and its metrics.

    ::

        r    = exp(log_prob - old_log_prob)
        pg   = mean(max(-A * r, -A * clamp(r, 1 - clip_range, 1 + clip_range)))
        kl   = mean_b(mean_{non-batch}((prev_sample_mean - ref_prev_sample_mean)^2) / (2 std_dev_t_b^2))
        loss = (pg + kl_coef * kl) / normalizer

    Args:
        log_prob: ``[B]`` the policy's log-prob of the stored ``x_prev`` (carries the gradient).
        old_log_prob: ``[B]`` the rollout policy's log-prob (treated as a constant: detached).
        advantages: ``[B]`` group-relative advantages (detached).
        clip_range: PPO ``eps`` (flow_grpo, DanceGRPO and verl-omni default to 1e-4; flow_grpo's Wan config 1e-3).
        normalizer: divides the loss, e.g. ``num_micro_batches * W`` for gradient accumulation.
        kl_coef: ``beta``; when > 0, ``prev_sample_mean`` ``[B, ...]``, ``ref_prev_sample_mean`` ``[B, ...]``
            (detached) and ``std_dev_t`` (``[B]`` or scalar, as in :class:`SDEStep`) are required.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor; ``metrics`` holds detached 0-d float tensors
        ``loss`` (``pg + kl_coef * kl``, before ``normalizer``), ``policy_loss`` (pg), ``kl`` (0 when
        unused), ``ppo_kl`` (``mean(old_log_prob - log_prob)`` = ``mean(-log r)``), ``clipfrac``
        (fraction with ``|r - 1| > clip_range``), ``ratio_mean``, ``ratio_std`` (population std).
    """
    if log_prob.ndim != 1:
        raise ValueError(
            f"flowgrpo_loss: log_prob must be 1-D [B], got shape {tuple(log_prob.shape)}; pass the "
            "SDEStep.log_prob of one window step."
        )
    batch = log_prob.shape[0]
    _check_batch_vector(old_log_prob, "old_log_prob", batch)
    _check_batch_vector(advantages, "advantages", batch)
    if not clip_range > 0:
        raise ValueError(
            f"flowgrpo_loss: clip_range must be > 0, got {clip_range!r}; flow_grpo, DanceGRPO and verl-omni "
            "default to 1e-4."
        )
    if not normalizer > 0:
        raise ValueError(
            f"flowgrpo_loss: normalizer must be > 0, got {normalizer!r}; pass num_micro_batches * W (or 1)."
        )
    if not kl_coef >= 0:
        raise ValueError(
            f"flowgrpo_loss: kl_coef must be >= 0, got {kl_coef!r}; pass 0 to disable the KL term."
        )

    # Ratios of exp(small differences) lose their precision in bf16; keep at least float32.
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = advantages.detach().to(dtype)

    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg = torch.maximum(unclipped, clipped).mean()

    if kl_coef > 0:
        kl = _kl_term(prev_sample_mean, ref_prev_sample_mean, std_dev_t, batch, dtype)
    else:
        kl = pg.new_zeros(())
    total = pg + kl_coef * kl
    loss = total / normalizer

    metrics = ratio_metrics(total, pg, kl, lp - old, ratio)
    metrics["clipfrac"] = ((ratio.detach() - 1.0).abs() > clip_range).to(dtype).mean()
    return loss, metrics
