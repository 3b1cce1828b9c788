"""LTX-Video's and ChronoEdit's plans do not split a per-token timestep.

Defect: both forwards take a timestep per video token (``[B, N]``: LTX's image-to-video and condition
pipelines pass one, the conditioning tokens at another noise level than the rest; ChronoEdit's forward takes
the Wan-2.2-TI2V form), and turn it into one modulation per token. Their ``_cp_plan`` splits the video tokens
but not the timestep, so each rank modulates its ``N / P`` tokens with ``N`` rows:
``RuntimeError: The size of tensor a (N/P) must match the size of tensor b (N)`` in the first block. Wan's own
plan has the entry (``"": {"timestep": split dim 1, 2-D only}``); these two lack it.
Affected: every release with context parallelism, 0.36-0.42 (both classes, unchanged plans). Upstream: none
filed (transformer_ltx.py / transformer_chronoedit.py ``_cp_plan``).
Fix: the plans gain Wan's root entry: a 2-D timestep is split along the tokens exactly as the video tokens
are (the same ``tensor_split`` rule, so any length); a ``[B]`` timestep is left alone (``expected_dims=2``).
"""

from __future__ import annotations

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "per_token_timestep"
AFFECTED = "0.36-0.42"
UPSTREAM = "none filed (transformer_ltx.py, transformer_chronoedit.py _cp_plan)"

CLASSES = ("LTXVideoTransformer3DModel", "ChronoEditTransformer3DModel")

_swaps = AttributeSwaps()


def _unsplit() -> list[type]:
    """The classes whose plan does not split a per-token timestep at the root."""
    import diffusers

    found = []
    for name in CLASSES:
        cls = getattr(diffusers, name, None)
        plan = getattr(cls, "_cp_plan", None)
        if plan is not None and "timestep" not in plan.get("", {}):
            found.append(cls)
    return found


def probe() -> Probe:
    unsplit = _unsplit()
    if unsplit:
        names = ", ".join(c.__name__ for c in unsplit)
        return Probe(True, f"{names}: the plan splits the video tokens but not a [B, N] timestep")
    return Probe(False, "per-token timesteps are split with the video tokens")


def apply() -> None:
    if _swaps.active:
        return
    from diffusers.models._modeling_parallel import ContextParallelInput

    for cls in _unsplit():
        plan = dict(cls._cp_plan)
        root = dict(plan.get("", {}))
        root["timestep"] = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)
        plan[""] = root
        _swaps.set(cls, "_cp_plan", plan)
        logger.info("patched %s._cp_plan: a [B, N] timestep is split with the video tokens", cls.__name__)


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
