"""Group-relative advantages (the "GR" of GRPO): each reward against the other samples of its prompt."""

from __future__ import annotations

import torch

__all__ = ["group_advantages"]

_STD_MODES = ("batch", "group")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std: str = "batch",
    eps: float = 1e-4,
    clip: float = 5.0,
) -> torch.Tensor:
    """Advantages ``[N]``: ``(reward - mean of its group) / (std + eps)``, clamped to ``[-clip, clip]``.

    Args:
        rewards: ``[N]`` one scalar reward per sample.
        group_ids: ``[N]`` integer id of each sample's prompt group (any integers, need not be contiguous).
        std: ``"batch"`` (default, Flow-GRPO's choice) divides by the std of all ``N`` rewards;
            ``"group"`` by the std of the sample's own group (a group of one gets advantage 0).
        eps: added to the std so that a group (or batch) of equal rewards gives 0, not NaN.
        clip: the advantages are clamped to ``[-clip, clip]`` (``adv_clip_max``).

    Stds are population stds (divide by ``n``, ``correction=0``), like ``numpy.std`` in the
    flow_grpo and verl-omni implementations. Computed in float64; returned in ``rewards``' floating dtype
    (float32 for integer rewards).
    """
    fn = "group_advantages"
    if rewards.ndim != 1:
        raise ValueError(
            f"{fn}: rewards must be 1-D [N], got shape {tuple(rewards.shape)}; pass one scalar per sample "
            "(flatten or select the reward before broadcasting it over the window steps)."
        )
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"{fn}: group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}; pass one "
            "prompt-group id per sample."
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"{fn}: group_ids must be an integer tensor, got dtype {group_ids.dtype}; pass e.g. "
            "torch.arange(num_prompts).repeat_interleave(group_size)."
        )
    if std not in _STD_MODES:
        raise ValueError(f"{fn}: std must be one of {_STD_MODES}, got {std!r}.")
    if not eps > 0:
        raise ValueError(
            f"{fn}: eps must be > 0 (a group of equal rewards would divide 0 by 0), got {eps!r}; the default "
            "1e-4 is the reference value."
        )
    if not clip > 0:
        raise ValueError(f"{fn}: clip must be > 0, got {clip!r}; the default 5.0 is the reference value.")
    if rewards.numel() == 0:
        raise ValueError(f"{fn}: rewards is empty; pass at least one sample.")

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.detach().to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    counts = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    group_mean = torch.zeros_like(counts).index_add_(0, inverse, r) / counts
    centered = r - group_mean[inverse]
    if std == "batch":
        scale = r.std(correction=0)
    else:
        group_var = torch.zeros_like(counts).index_add_(0, inverse, centered**2) / counts
        scale = group_var.sqrt()[inverse]
    adv = (centered / (scale + eps)).clamp(-clip, clip)
    return adv.to(out_dtype)
