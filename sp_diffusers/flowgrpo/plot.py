"""Reward and loss curves of a run, as a PNG (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_metrics(history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Reward mean (± std), loss, ppo_kl and grad norm per iteration; None when matplotlib is missing."""
    if not history:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [m["iteration"] for m in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    mean = [m["reward_mean"] for m in history]
    std = [m.get("reward_std", 0.0) for m in history]
    axes[0].plot(its, mean, color="tab:green", label="reward mean")
    axes[0].fill_between(
        its,
        [a - b for a, b in zip(mean, std, strict=True)],
        [a + b for a, b in zip(mean, std, strict=True)],
        color="tab:green",
        alpha=0.15,
        label="± std",
    )
    window = max(1, len(mean) // 10)
    smooth = [
        sum(mean[max(0, i - window + 1) : i + 1]) / len(mean[max(0, i - window + 1) : i + 1])
        for i in range(len(mean))
    ]
    axes[0].plot(its, smooth, color="black", lw=1.5, label=f"moving mean ({window})")
    axes[0].set(title="reward", xlabel="iteration")
    axes[0].legend(fontsize=8)
    axes[1].plot(its, [m.get("loss", float("nan")) for m in history], color="tab:blue")
    axes[1].set(title="FlowGRPO loss (unscaled)", xlabel="iteration")
    axes[2].plot(its, [m.get("grad_norm", float("nan")) for m in history], color="tab:red", label="grad norm")
    ax2 = axes[2].twinx()
    ax2.plot(
        its, [m.get("ppo_kl", float("nan")) for m in history], color="tab:purple", lw=0.8, label="ppo_kl"
    )
    axes[2].set(title="grad norm (red) / ppo_kl (purple)", xlabel="iteration")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
