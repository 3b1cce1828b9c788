"""``flowgrpo.algorithm`` -> its :class:`~.base.Algorithm`: adding an algorithm is one module and one line here."""

from __future__ import annotations

import dataclasses
import math
import warnings

from ..config import ConfigError, TrainConfig
from .base import Algorithm
from .dance_grpo import DanceGRPO
from .diffusion_dpo import DiffusionDPO
from .diffusion_nft import DiffusionNFT
from .flow_dppo import FlowDPPO
from .flow_grpo import FlowGRPO
from .gardo import GARDO
from .grpo_guard import GRPOGuard
from .mix_grpo import MixGRPO

__all__ = ["ALGORITHMS", "UnreadKeyWarning", "algorithm_class", "algorithm_for", "check_algorithm_keys"]


class UnreadKeyWarning(UserWarning):
    """A shared ``flowgrpo`` key the run's algorithm does not read, set away from its default."""


ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FlowGRPO, DanceGRPO, GRPOGuard, MixGRPO, DiffusionNFT, FlowDPPO, DiffusionDPO, GARDO)
}


def algorithm_class(config: TrainConfig) -> type[Algorithm]:
    """``flowgrpo.algorithm``'s class (its keys not checked: a schedule needs only its ``schedule_kind``)."""
    name = config.flowgrpo.algorithm
    if name not in ALGORITHMS:
        raise ConfigError(f"flowgrpo.algorithm={name!r}: choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def check_algorithm_keys(config: TrainConfig) -> None:
    """The algorithm's name and its own keys (``Algorithm.check``); another algorithm's section set away from its
    defaults is refused: the chosen algorithm would not read it."""
    chosen = algorithm_class(config)
    for cls in ALGORITHMS.values():
        if cls is chosen or cls.section is None:
            continue
        section = getattr(config.flowgrpo, cls.section)
        fresh = type(section)()
        changed = [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(fresh, f.name)]
        if changed:
            keys = ", ".join(f"flowgrpo.{cls.section}.{k}={getattr(section, k)!r}" for k in changed)
            raise ConfigError(
                f"{keys}: read by {cls.name} only, and flowgrpo.algorithm={chosen.name} does nothing with it; fix: "
                f"drop it, or flowgrpo.algorithm={cls.name}"
            )
    g, fresh = config.flowgrpo, type(config.flowgrpo)()
    # the shared keys are warned, not refused: a config written for one algorithm and switched to another
    # (--set flowgrpo.algorithm=...) carries them, and such configs are shared; the sections above are refused
    unread = [k for k in chosen.ignored(config) if getattr(g, k) != getattr(fresh, k)]
    if unread:
        keys = ", ".join(f"flowgrpo.{k}={getattr(g, k)!r}" for k in unread)
        warnings.warn(
            f"{keys}: flowgrpo.algorithm={chosen.name} (flowgrpo.sde_steps={g.sde_steps}) does not read it, so it "
            "changes nothing in this run; fix: drop it (docs/training.md says which keys each algorithm reads)",
            UnreadKeyWarning,
            stacklevel=2,
        )
    if config.update.lag and not chosen.trains_lagged:
        takers = ", ".join(n for n, c in ALGORITHMS.items() if c.trains_lagged)
        raise ConfigError(
            f"update.lag={config.update.lag}: the update trains the previous iteration's rollout, and "
            f"flowgrpo.algorithm={chosen.name} keeps more of the policy that sampled than its log-probs; fix: "
            f"update.lag=0, or one of {takers}"
        )
    if not (math.isfinite(g.kl_reward) and g.kl_reward >= 0):
        raise ConfigError(f"flowgrpo.kl_reward={g.kl_reward!r} must be a finite number >= 0 (0: off)")
    if g.kl_reward > 0 and not chosen.takes_kl_reward:
        takers = ", ".join(n for n, c in ALGORITHMS.items() if c.takes_kl_reward)
        raise ConfigError(
            f"flowgrpo.kl_reward={g.kl_reward}: folds a stored SDE step's KL into its reward, which "
            f"flowgrpo.algorithm={chosen.name} does not train on; fix: drop it, or one of {takers}"
        )
    if g.kl_reward > 0 and g.per_sample_windows:
        raise ConfigError(
            "flowgrpo.kl_reward with per_sample_windows: the per-step advantages normalise each trained step's column "
            "over a prompt group, and per-sample windows put different timesteps in one column; fix: one of them"
        )
    chosen.check(config)


def algorithm_for(config: TrainConfig) -> Algorithm:
    """The run's algorithm, its keys checked."""
    cls = algorithm_class(config)
    cls.check(config)
    return cls(config)
