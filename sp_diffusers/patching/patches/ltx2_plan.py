"""LTX-2's plan splits the video stream only: the audio stream runs replicated, a2v/v2a attention fails.

Defect: ``LTX2VideoTransformer3DModel._cp_plan`` is LTX-Video's plan, byte for byte: it splits the video
tokens, the video prompt and mask, and the video RoPE (as 3-D tables), and gathers ``proj_out``. For training:

* the audio-to-video cross-attention fails in the first block: its query RoPE (``cross_attn_rope``, one row per
  video token) is not split, the video queries are (``The size of tensor a (N/P) must match ... (N)``);
* with ``rope_type="split"`` (the tables are ``[B, H, T, D/2]``) ``expected_dims=3`` skips the video RoPE split
  and the video self-attention fails the same way;
* a per-token video timestep (``[B, N]``, the image-to-video pipeline) is not split: the first block fails;
* were those fixed, the audio stream would still run whole on every rank and ``audio_proj_out`` is not
  gathered: each rank's audio loss gradient is complete, so the SUM over the sequence-parallel group counts
  every audio parameter, and the audio share of every shared parameter, P times. No loss scale fixes that.

Affected: 0.37-0.42 (every release with LTX-2). Upstream: none filed (transformer_ltx2.py ``_cp_plan``).
Fix: a plan that splits both streams. Video and audio tokens, both prompts and masks, both timesteps when per
token (2-D), the keyframe marker (0.42), and all four RoPE tables (video, audio, and the a2v / v2a cross-
attention positions of each) along their token dim - dim 1 of ``[B, T, D]`` for ``rope_type="interleaved"``,
dim 2 of ``[B, H, T, D/2]`` for ``"split"``, chosen per model from its config - and ``proj_out`` and
``audio_proj_out`` gathered. Each token's RoPE row stays with the token, so the attentions (self, text,
a2v, v2a) see the single-process positions; any length of either stream. Optional inputs a call leaves out
need ``plan_optional_inputs`` (applied with this patch). ``video_self_attention_mask`` ``[B, N, N]`` (IC-LoRA)
is not split: it would need query rows local and key columns global, which diffusers' processor cannot
take (its ``prepare_attention_mask`` pads a key dim that differs from the local length).
"""

from __future__ import annotations

import inspect
from typing import Any

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "ltx2_plan"
AFFECTED = "0.37-0.42"
UPSTREAM = "none filed (transformer_ltx2.py _cp_plan)"

_ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
_swaps = AttributeSwaps()


def _ltx2():
    import diffusers

    return getattr(diffusers, "LTX2VideoTransformer3DModel", None)


def probe() -> Probe:
    cls = _ltx2()
    if cls is None:
        return Probe(False, "no LTX2VideoTransformer3DModel in this diffusers")
    plan = vars(cls).get("_cp_plan")
    if isinstance(plan, dict) and "audio_proj_out" not in plan:
        return Probe(True, "LTX-2's plan splits the video stream only (audio replicated, a2v RoPE unsplit)")
    return Probe(False, "LTX-2's plan splits both streams")


def training_plan(rope_type: str = "interleaved", forward_params: tuple[str, ...] = ()) -> dict[str, Any]:
    """The two-stream plan for one ``rope_type``; ``forward_params`` (the model's forward parameters) decide
    whether the version's forward has ``video_keyframes_mask`` to split."""
    from diffusers.models._modeling_parallel import ContextParallelInput as In
    from diffusers.models._modeling_parallel import ContextParallelOutput as Out

    if rope_type not in ("interleaved", "split"):
        raise ValueError(
            f"LTX-2 rope_type={rope_type!r}: the plan knows 'interleaved' and 'split' RoPE tables"
        )
    # token dim of the RoPE tables: [B, T, D] interleaved, [B, H, T, D/2] split
    rope_dim, rope_dims = (1, 3) if rope_type == "interleaved" else (2, 4)
    root = {
        name: In(split_dim=1, expected_dims=dims, split_output=False)
        for name, dims in (
            ("hidden_states", 3),
            ("audio_hidden_states", 3),
            ("encoder_hidden_states", 3),
            ("audio_encoder_hidden_states", 3),
            ("encoder_attention_mask", 2),
            ("audio_encoder_attention_mask", 2),
            ("timestep", 2),  # [B, N] only: a [B] timestep is left alone
            ("audio_timestep", 2),
        )
    }
    if "video_keyframes_mask" in forward_params:  # 0.42: [B, N, 1], one marker per video token
        root["video_keyframes_mask"] = In(split_dim=1, expected_dims=3, split_output=False)
    plan: dict[str, Any] = {"": root}
    for name in _ROPES:
        plan[name] = {i: In(split_dim=rope_dim, expected_dims=rope_dims, split_output=True) for i in (0, 1)}
    plan["proj_out"] = Out(gather_dim=1, expected_dims=3)
    plan["audio_proj_out"] = Out(gather_dim=1, expected_dims=3)
    return plan


class _PlanOfRopeType:
    """``_cp_plan`` as a per-model value: the RoPE tables' layout (and so the split dim) is a config choice.

    Read on the class (diffusers and sp_diffusers check for a plan there) it is the ``"interleaved"`` plan.
    """

    def __init__(self, cls: type) -> None:
        self._params = tuple(inspect.signature(cls.forward).parameters)
        self._plans: dict[str, dict] = {}

    def _plan(self, rope_type: str) -> dict:
        if rope_type not in self._plans:
            self._plans[rope_type] = training_plan(rope_type, self._params)
        return self._plans[rope_type]

    def __get__(self, model: Any, owner: type) -> dict:
        if model is None:
            return self._plan("interleaved")
        return self._plan(getattr(model.config, "rope_type", "interleaved"))


def apply() -> None:
    if _swaps.active:
        return
    cls = _ltx2()
    if cls is None:
        return
    _swaps.set(cls, "_cp_plan", _PlanOfRopeType(cls))
    logger.info("patched LTX2VideoTransformer3DModel._cp_plan: both streams split, both outputs gathered")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
