"""diffusers 0.36's Wan plan splits the text context, which breaks Wan-2.1 image-to-video silently.

Defect: 0.36's ``WanTransformer3DModel._cp_plan`` splits ``encoder_hidden_states`` at every block. Wan-2.1-I2V
(``image_dim`` set) puts 257 CLIP image tokens before the 512 text tokens, and its processor separates them by
position, ``image_context_length = encoder_hidden_states.shape[1] - 512`` (transformer_wan.py:89): on a
shard of ``769 / P`` tokens that is negative, and the image attention runs on the wrong tokens. Divisible
lengths (e.g. 257 + 511) give a silently wrong output; with lengths that do not divide the degree (769 at
P = 2), which the ``uneven_sharding`` patch shards instead of refusing, every I2V call would be silently wrong.
Affected: 0.36 (0.37 dropped the entry; the cross-attention then attends to the whole context locally).
Upstream: diffusers PR #12660 (plan) and #12909 (local cross-attention).
Fix: 0.36's plan without the ``blocks.*`` entry, i.e. the plan of 0.37-0.42. Each rank's queries then
attend to the whole (replicated) context. 0.36's processor still hands the cross-attention to the context-
parallel backend, which all-to-alls the replicated keys: every key arrives P times, which leaves the softmax
unchanged and gives each copy 1/P of its gradient, so outputs and summed gradients stay exact.
"""

from __future__ import annotations

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "wan_text_split"
AFFECTED = "0.36"
UPSTREAM = "diffusers PR #12660 / #12909 (fixed in 0.37)"

_swaps = AttributeSwaps()


def _wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


def probe() -> Probe:
    if "encoder_hidden_states" in _wan()._cp_plan.get("blocks.*", {}):
        return Probe(True, "Wan's plan splits the text context; I2V separates image tokens by position")
    return Probe(False, "Wan's plan keeps the text context whole")


def apply() -> None:
    if _swaps.active:
        return
    cls = _wan()
    plan = {k: v for k, v in cls._cp_plan.items() if k != "blocks.*"}
    _swaps.set(cls, "_cp_plan", plan)
    logger.info("patched WanTransformer3DModel._cp_plan: the text context is not split (as from 0.37)")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
