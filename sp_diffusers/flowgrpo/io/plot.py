"""What a person watching an RL run looks at, as one PNG (matplotlib, headless).

Panels: the reward (mean and +- std per iteration, with a moving mean, and the eval reward of ``train.eval_every``
as points), the clip fraction, the gradient norm,
the KL to the reference policy, and the learning rate. The GRPO loss is left out on purpose: on-policy it is
~0 by construction (the ratio is 1), so its curve says nothing; ppo_kl likewise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_metrics"]

# why a panel is flat zero, said on the panel
_FLAT_NOTES = {
    "kl": "no KL term\n(flowgrpo.kl_coef = 0)",
    "clipfrac": "nothing clipped: one optimizer step\nper rollout is on-policy (ratio 1)",
}


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot_metrics(history: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Write the run's panels to ``path``; None when there is no history or matplotlib is missing."""
    if not history:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [m["iteration"] for m in history]

    def series(key: str) -> list[float]:
        return [float(m.get(key, float("nan"))) for m in history]

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.8))
    reward, spread = series("reward_mean"), series("reward_std")
    ax = axes[0]
    ax.plot(its, reward, color="tab:green", lw=1, label="mean")
    ax.fill_between(
        its,
        [a - b for a, b in zip(reward, spread, strict=True)],
        [a + b for a, b in zip(reward, spread, strict=True)],
        color="tab:green",
        alpha=0.15,
        label="± std over samples",
    )
    window = max(1, len(reward) // 10)
    ax.plot(its, _moving_mean(reward, window), color="black", lw=1.5, label=f"moving mean ({window})")
    evals = [(m["iteration"], float(m["eval_reward_mean"])) for m in history if "eval_reward_mean" in m]
    if evals:  # train.eval_every: the held-out prompts, ODE from fixed noise
        ax.plot(*zip(*evals, strict=True), "o-", color="tab:blue", ms=4, lw=1, label="eval (held-out, ODE)")
    ax.set(title="reward", xlabel="iteration", ylabel="reward")
    ax.legend(fontsize=8)
    panels = [
        ("clipfrac", "clip fraction", "share of ratios clipped", "tab:orange"),
        ("grad_norm", "gradient norm", "L2 norm (before clipping)", "tab:red"),
        ("kl", "KL to the reference policy", "KL (adapters-off model)", "tab:purple"),
        ("lr", "learning rate", "lr", "tab:blue"),
    ]
    for ax, (key, name, ylabel, color) in zip(axes[1:], panels, strict=True):
        values = series(key)
        ax.plot(its, values, color=color)
        ax.set(title=name, xlabel="iteration", ylabel=ylabel)
        if key in _FLAT_NOTES and all(v == 0.0 for v in values):
            ax.text(0.5, 0.5, _FLAT_NOTES[key], ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
