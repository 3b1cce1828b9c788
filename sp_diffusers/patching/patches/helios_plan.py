"""Helios' plan computes the residual stream whole on every rank: training gradients are wrong.

Defect: 0.38+'s ``HeliosTransformer3DModel._cp_plan`` splits the *inputs* of every block's ``attn1``,
``attn2`` and ``ffn`` and gathers their *outputs* (``blocks.{i}.* for i in range(40)``); the residual stream,
norms, modulations, ``norm_out`` and ``proj_out`` run whole on every rank. diffusers' gather backward hands
each rank only its own piece of the gradient, so behind every gather the residual path carries the complete
gradient on every rank while each branch carries 1/P of it: after the SUM over the sequence-parallel group
(the gradient contract) ``norm_out``, ``proj_out`` and every modulation gate count P times, the branches once,
the embedders a mix. No loss scale fixes that: the plan serves inference only. It also names 40 blocks
(``enable_parallelism`` fails on fewer: ``'39' is not a submodule``; blocks past 40 are split, never
gathered). 0.37.1's plan splits the stream at ``blocks.0`` but gathers at ``blocks.39`` (``norm_out`` /
``proj_out`` replicated: the same P-fold gradients) and fails outright with the default
``guidance_cross_attn=True``: the blocks split history from current tokens with the *global* current length
(``torch.split(hidden_states, [local - global, global])``).
Affected: 0.37-0.42 (every release with Helios). Upstream: none filed (transformer_helios.py ``_cp_plan``).
Fix: a training plan - the residual stream split where it enters ``blocks.0``, ``proj_out`` gathered - and
the two modules that read ``original_context_length`` (the number of current, non-history tokens, which
come after the history tokens) given this rank's count. A block (``HeliosTransformerBlock.forward``) takes
its rank's rows of the per-token modulation and RoPE tables (the ``tensor_split`` rule of the sequence
split) and the current tokens among its own; ``HeliosOutputNorm`` keeps this rank's current tokens and their
modulation rows (possibly none: a rank may hold history only). History-key amplification and the guidance
cross-attention then see this rank's history / current split, and the gathered output is the single-process
one. Models whose residual stream is not split (diffusers' own plan passed as ``cp_plan=``) are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "helios_plan"
AFFECTED = "0.37-0.42"
UPSTREAM = "none filed (transformer_helios.py _cp_plan)"

# set on norm_out by enable_parallelism: the output norm has no attention processor to read the config from
CONFIG_ATTR = "_sp_diffusers_parallel_config"

_swaps = AttributeSwaps()


def _module():
    import diffusers

    if getattr(diffusers, "HeliosTransformer3DModel", None) is None:
        return None
    from diffusers.models.transformers import transformer_helios

    return transformer_helios


def probe() -> Probe:
    mod = _module()
    if mod is None:
        return Probe(False, "no HeliosTransformer3DModel in this diffusers")
    plan = vars(mod.HeliosTransformer3DModel).get("_cp_plan") or {}
    if "proj_out" not in plan:
        return Probe(True, "Helios' plan gathers inside the blocks: the residual stream is replicated")
    return Probe(False, "Helios' plan splits the residual stream and gathers proj_out")


def training_plan() -> dict[str, Any]:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _local_rows(config: Any, total: int, local: int, history: int) -> tuple[int, int, int, int] | None:
    """This rank's ``(start, n, current_offset, current)``: its rows ``[start, start + n)`` of the ``total``
    tokens (history first), where its current tokens begin and how many there are. None when the stream is
    not split (no context parallelism, or a plan that keeps the residual stream whole)."""
    from ...parallel.cp_groups import cp_groups
    from ...parallel.exchange import split_sizes

    groups = cp_groups(config)
    if groups is None or local == total:
        return None
    sizes = split_sizes(total, groups.world)
    start, n = sum(sizes[: groups.cp_rank]), sizes[groups.cp_rank]
    if local != n:
        raise ValueError(
            f"Helios under context parallelism: this rank holds {local} of {total} tokens, but the sequence "
            f"split gives it {n}; fix: split the residual stream with sp_diffusers' Helios plan (the default "
            "after sp_diffusers.install()) and do not pass another cp_plan"
        )
    offset = min(max(history - start, 0), n)
    return start, n, offset, n - offset


def _block_forward(original):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, original_context_length=None):
        if original_context_length is not None:
            total = rotary_emb.shape[1]  # one RoPE row per token of the whole (history + current) sequence
            rows = _local_rows(
                self.attn1.processor._parallel_config,
                total,
                hidden_states.shape[1],
                total - original_context_length,
            )
            if rows is not None:
                start, n, _, current = rows
                rotary_emb = rotary_emb.narrow(1, start, n)
                if temb.ndim == 4:  # [B, S, 6, D]: one modulation per token
                    temb = temb.narrow(1, start, n)
                original_context_length = current
        return original(self, hidden_states, encoder_hidden_states, temb, rotary_emb, original_context_length)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def _norm_forward(original):
    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, original_context_length: int):
        total = temb.shape[1]  # [B, S, D]: one row per token of the whole sequence
        rows = _local_rows(
            getattr(self, CONFIG_ATTR, None), total, hidden_states.shape[1], total - original_context_length
        )
        if rows is not None:
            # only this rank's current tokens (possibly none) and their rows; the gather of proj_out puts the
            # ranks' current tokens back in order
            start, _, offset, current = rows
            hidden_states = hidden_states.narrow(1, offset, current)
            temb = temb.narrow(1, start + offset, current)
            original_context_length = current
        return original(self, hidden_states, temb, original_context_length)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def _enable_parallelism(cls: type):
    def enable_parallelism(self, *args, **kwargs):
        result = super(cls, self).enable_parallelism(*args, **kwargs)
        processor = self.blocks[0].attn1.processor if len(self.blocks) else None
        setattr(self.norm_out, CONFIG_ATTR, getattr(processor, "_parallel_config", None))
        return result

    return enable_parallelism


def apply() -> None:
    if _swaps.active:
        return
    mod = _module()
    if mod is None:
        return
    model = mod.HeliosTransformer3DModel
    _swaps.set(model, "_cp_plan", training_plan())
    _swaps.set(model, "enable_parallelism", _enable_parallelism(model))
    _swaps.set(mod.HeliosTransformerBlock, "forward", _block_forward(mod.HeliosTransformerBlock.forward))
    _swaps.set(mod.HeliosOutputNorm, "forward", _norm_forward(mod.HeliosOutputNorm.forward))
    logger.info("patched Helios: the residual stream is split (training plan), proj_out gathered")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
