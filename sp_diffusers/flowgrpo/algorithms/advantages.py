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
    correction: int = 0,
) -> torch.Tensor:
    """Advantages ``[N]``: ``(reward - mean of its group) / (std + eps)``, clamped to ``[-clip, clip]``.

    Args:
        rewards: ``[N]`` one scalar reward per sample.
        group_ids: ``[N]`` integer id of each sample's prompt group (any integers, need not be contiguous).
        std: ``"batch"`` (default, Flow-GRPO's choice) divides by the std of all ``N`` rewards;
            ``"group"`` by the std of the sample's own group (a group of one gets advantage 0).
        eps: added to the std so that a group (or batch) of equal rewards gives 0, not NaN.
        clip: the advantages are clamped to ``[-clip, clip]`` (``adv_clip_max``).
        correction: the std divides the squared deviations by ``n - correction``. The references differ:

            - flow_grpo: ``numpy.std``, population (``correction=0``, the default), of the whole gathered batch
              (``global_std``) + 1e-4;
            - DanceGRPO: ``torch.Tensor.std`` of each group, unbiased (``std="group", correction=1``) + 1e-8;
            - verl-omni: ``torch.std`` (unbiased) of the whole batch + 1e-4, but over the rewards repeated
              across the T stored window steps (``[B, T]``), so its ``n - 1`` is ``B T - 1``: between the
              unbiased and the population std of the B rewards, not equal to either for T > 1.

    A group whose rewards are all equal gets advantage exactly 0 (not a rounding residue of its mean), so
    such samples can be recognised and dropped (``flowgrpo.drop_zero_advantage``). Computed in float64;
    returned in ``rewards``' floating dtype (float32 for integer rewards).
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
    if correction not in (0, 1):
        raise ValueError(f"{fn}: correction must be 0 (population std) or 1 (unbiased), got {correction!r}.")
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
    # a constant group: exactly 0 (its float mean may differ from the value by an ulp)
    group_max = torch.full_like(counts, -torch.inf).scatter_reduce(0, inverse, r, "amax")
    group_min = torch.full_like(counts, torch.inf).scatter_reduce(0, inverse, r, "amin")
    centered = torch.where((group_max == group_min)[inverse], torch.zeros_like(centered), centered)
    if std == "batch":
        scale = r.std(correction=correction) if r.numel() > correction else r.new_zeros(())
    else:
        # a group of one has no unbiased std: 0 (its advantage is 0 anyway)
        denom = (counts - correction).clamp_min(1.0)
        group_var = torch.zeros_like(counts).index_add_(0, inverse, centered**2) / denom
        scale = group_var.sqrt()[inverse]
    adv = (centered / (scale + eps)).clamp(-clip, clip)
    return adv.to(out_dtype)
