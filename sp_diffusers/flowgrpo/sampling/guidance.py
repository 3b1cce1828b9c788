"""Classifier-free guidance in one forward, and the weights a rollout holds gathered while it uses them.

**One forward.** The conditional and the unconditional branch become one batch of 2B samples: latents and
timesteps repeated, the two texts stacked. Their lengths differ (a prompt against the empty prompt), so both are
padded to the longer (zeros, mask False) - what the trainer already does for the ragged prompts of one batch:
a masked key takes no part in attention, and the families without a text mask (Wan, FLUX.1) zero the masked rows
and cut or pad the text to a fixed length anyway. The batched forward therefore equals the two separate ones (to
fp32 rounding), under SP too: one forward's exchanges, parameter gathers and agreement instead of two.

**Held weights.** :class:`WeightHolder` keeps the parameters of the engine a rollout uses gathered from its first
forward to the end (``FSDPEngine.gathered_params``); a two-expert model holds one expert at a time and switches
once, where the schedule crosses the boundary.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ...parallel.devices import collective_device
from ...parallel.ledger import comm_kind

__all__ = ["WeightHolder", "gathers_once", "guided", "paired"]


def _pad_to(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` ``[B, L, ...]`` padded with zeros (False for a mask) to ``length`` rows along dim 1."""
    if t.shape[1] == length:
        return t
    pad = t.new_zeros((t.shape[0], length - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], dim=1)


def paired(cond: dict[str, Any]) -> dict[str, Any]:
    """The text of both branches as one batch: ``prompt_embeds [2B, L, D]`` (conditional first), its mask (and its
    host lengths where the batch carries them: Z-Image's), the pooled embeddings where the family has them and an
    image condition repeated; ``L`` the longer of the two texts."""
    pos, neg = cond["prompt_embeds"], cond["negative_prompt_embeds"]
    length = max(pos.shape[1], neg.shape[1])
    out = {
        "prompt_embeds": torch.cat([_pad_to(pos, length), _pad_to(neg.to(pos.dtype), length)]),
        "prompt_embeds_mask": torch.cat(
            [
                _pad_to(cond["prompt_embeds_mask"], length),
                _pad_to(cond["negative_prompt_embeds_mask"], length),
            ]
        ),
    }
    lengths = cond.get("prompt_embeds_lengths")  # each row's valid length, on the host (Z-Image's)
    if lengths is not None:
        out["prompt_embeds_lengths"] = [*lengths, *cond["negative_prompt_embeds_lengths"]]
    if cond.get("prompt_embeds_2") is not None:  # a second text stream, stacked as the first
        pos_2, neg_2 = cond["prompt_embeds_2"], cond["negative_prompt_embeds_2"]
        length_2 = max(pos_2.shape[1], neg_2.shape[1])
        out["prompt_embeds_2"] = torch.cat([_pad_to(pos_2, length_2), _pad_to(neg_2.to(pos_2.dtype), length_2)])
        out["prompt_embeds_mask_2"] = torch.cat(
            [_pad_to(cond["prompt_embeds_mask_2"], length_2), _pad_to(cond["negative_prompt_embeds_mask_2"], length_2)]
        )
    for key, value in cond.items():  # an image condition is the same for both branches (conditioning.py)
        if key.startswith("condition_"):
            if torch.is_tensor(value):
                out[key] = torch.cat([value, value])
            else:  # host values: each row's count of condition images (a list), every rank's counts (a tuple)
                out[key] = [*value, *value] if isinstance(value, list) else value
    if cond.get("pooled_prompt_embeds") is not None:
        out["pooled_prompt_embeds"] = torch.cat(
            [cond["pooled_prompt_embeds"], cond["negative_pooled_prompt_embeds"]]
        )
    return out


def guided(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The guided velocity, as every diffusers pipeline forms it."""
    return v_uncond + scale * (v_cond - v_uncond)


def gathers_once(mode: str, engine: Any) -> bool:
    """``rollout.gather_params``: ``always`` / ``never`` as said; ``auto`` where holding the whole model fits the
    device on every rank (``FSDPEngine.gather_fits``; one all-reduce, once per run, so every rank decides alike:
    ranks that disagree would pair different all-gathers)."""
    if mode != "auto":
        return mode == "always"
    fits = bool(engine.gather_fits())
    group = engine.control_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(fits)], device=collective_device(group))
        with comm_kind("agreement"):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        fits = bool(flag.item())
    return fits


class WeightHolder:
    """``holder(engine)`` returns ``engine`` with its parameters gathered and kept until the holder is closed or
    another engine is asked for (then the previous one is resharded first: one expert's full weights at a time).
    Disabled: returns engines as they are (FSDP gathers per forward). Closing reshards every engine it met, the
    root's own parameters too (FSDP2 keeps those gathered until a backward, which a frozen expert never runs)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._engine: Any = None
        self._held: contextlib.AbstractContextManager | None = None
        self._seen: list[Any] = []

    def __call__(self, engine: Any) -> Any:
        if not any(engine is e for e in self._seen):
            self._seen.append(engine)
        if self.enabled and engine is not self._engine:
            self._let_go()
            held = engine.gathered_params()
            held.__enter__()
            self._engine, self._held = engine, held
        return engine

    def _let_go(self) -> None:
        if self._held is not None:
            held, self._held, self._engine = self._held, None, None
            held.__exit__(None, None, None)

    def release(self) -> None:
        self._let_go()
        for engine in self._seen:
            engine.release_params()
        self._seen = []

    def __enter__(self) -> WeightHolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
