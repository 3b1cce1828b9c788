"""HunyuanVideo (``HunyuanVideoTransformer3DModel``, text-to-video and token-replace image-to-video): no plan
in diffusers. Its processor routes attention through the dispatcher already; the mask it gets is in stream
order and must be reordered, and the token-replace blocks need this rank's first-frame token count.
"""

from __future__ import annotations

from typing import Any

import torch

from ...parallel.cp_groups import cp_groups, cp_world
from ._joint import block_parallel_config, bound_args, joint_sizes, to_all_to_all_order
from .assignments import register_plan, swap_processors

__all__ = ["HunyuanVideoJointAttnProcessor"]


class HunyuanVideoJointAttnProcessor:
    """diffusers' ``HunyuanVideoAttnProcessor2_0`` with the joint mask in the order context parallelism needs.

    diffusers' processor already routes attention through ``dispatch_attention_fn``; what breaks under a
    sequence split is the mask. ``HunyuanVideoTransformer3DModel.forward`` builds a key mask
    ``[B, 1, 1, N + T]`` over *global* lengths in stream order ``[video (N), text (T)]`` (our plan splits the
    streams at the first block, after the mask is built). Each rank attends over ``cat([video_r, text_r])``
    (``[B, N/P + T/P, H, D]``: dual-stream blocks concatenate the projected streams, single-stream blocks the
    hidden states), so the all-to-all orders the keys ``[video_0, text_0, video_1, text_1, ...]``; this
    processor reorders the mask's key (and, for a ``[.., S, S]`` mask, query) dim to that order and then runs
    diffusers' processor unchanged. With no parallelism it is diffusers' processor, bit for bit.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

        if (
            attention_mask is not None
            and encoder_hidden_states is not None
            and cp_world(self._parallel_config) > 1
        ):
            # the streams split where they enter the first block (dual- or single-stream)
            video, text = joint_sizes(
                self._parallel_config,
                [":hidden_states", ":encoder_hidden_states"],
                [hidden_states.shape[1], encoder_hidden_states.shape[1]],
                hidden_states.device,
            )
            attention_mask = self._in_all_to_all_order(
                attention_mask, video, text, cp_groups(self._parallel_config).cp_rank
            )
        # diffusers' processor reads only _attention_backend / _parallel_config from self: run it as ours
        return HunyuanVideoAttnProcessor2_0.__call__(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
        )

    @staticmethod
    def _in_all_to_all_order(
        mask: torch.Tensor, video: list[int], text: list[int], rank: int
    ) -> torch.Tensor:
        """Global stream-order mask (key dim ``N + T``) -> all-to-all key order; a local-length mask (this
        rank's ``video[rank] + text[rank]`` keys) is left for the backend to all-gather, which yields that
        order. ``video``/``text``: every rank's lengths of the two streams."""
        local, full = video[rank] + text[rank], sum(video) + sum(text)
        if mask.shape[-1] == local and local != full:
            return mask
        if mask.shape[-1] != full:
            raise ValueError(
                f"HunyuanVideoJointAttnProcessor: attention_mask has {mask.shape[-1]} keys, expected {full} "
                f"(global: {sum(video)} video + {sum(text)} text) or {local} (this rank's); "
                "fix: pass HunyuanVideoTransformer3DModel an encoder_attention_mask [B, T] of the (padded) text, "
                "and split the streams with sp_diffusers' HunyuanVideo plan"
            )
        mask = to_all_to_all_order(mask, -1, video, text)
        if mask.dim() >= 2 and mask.shape[-2] == full:  # a [.., S_q, S_kv] mask: queries are ordered likewise
            mask = to_all_to_all_order(mask, -2, video, text)
        return mask


def _local_first_frame_tokens(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of HunyuanVideo's token-replace blocks (I2V, ``image_condition_type="token_replace"``).

    Those blocks modulate the first ``num_tokens`` video tokens (the first latent frame) differently from the
    rest. Under a sequence split this rank holds global video tokens ``[start_r, start_r + N_r)``, so its
    first-frame count is ``clamp(num_tokens - start_r, 0, N_r)``. ``N_r`` is read from the RoPE tables, which
    the plan splits before any block runs (the block's own ``hidden_states`` is still global at block 0).
    """
    groups = cp_groups(block_parallel_config(block))
    if groups is None:
        return None
    names, bound = bound_args(block, args, kwargs)
    rope = bound.get("freqs_cis", bound.get("image_rotary_emb"))
    num_tokens = bound.get("num_tokens")
    if rope is None or num_tokens is None:
        return None
    video_local = rope[0].shape[0]  # [N_r, D] after the plan's split of the RoPE module's output
    (sizes,) = joint_sizes(block_parallel_config(block), ["rope:0"], [video_local], rope[0].device)
    start = sum(sizes[: groups.cp_rank])
    local = min(max(int(num_tokens) - start, 0), video_local)
    index = names.index("num_tokens")
    if index < len(args):
        args = (*args[:index], local, *args[index + 1 :])
    else:
        kwargs = {**kwargs, "num_tokens": local}
    return args, kwargs


def _hunyuan_video_plan(first_block: str = "transformer_blocks.0") -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    # Split at the first block, not at the embedders: the model builds its joint key mask from the video and
    # text lengths after embedding, which must still be the global ones. The token refiner (context_embedder)
    # thus runs on the whole text on every rank: its self-attention is masked per text token and its pooled
    # projection averages all valid tokens, both of which need the whole text; it is small. Single-stream
    # blocks receive the sharded streams from the dual-stream blocks and re-concatenate them per rank, which
    # keeps the same [video_r, text_r] key order.
    return {
        first_block: {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        # (cos, sin) tables [N, D], one row per video token in the same order: split like the video tokens
        "rope": {
            0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
            1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_hunyuan_video(model: torch.nn.Module) -> None:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    blocks = (*model.transformer_blocks, *model.single_transformer_blocks)
    if not len(model.transformer_blocks) and type(model)._cp_plan is not None:
        # no dual-stream block: this model's streams first meet in a single-stream block (same inputs)
        model._cp_plan = _hunyuan_video_plan("single_transformer_blocks.0")
    swap_processors(model, HunyuanVideoAttnProcessor2_0, HunyuanVideoJointAttnProcessor)
    if model.config.image_condition_type == "token_replace":
        for block in blocks:
            if not getattr(block, "_sp_diffusers_first_frame_hook", False):
                block.register_forward_pre_hook(_local_first_frame_tokens, with_kwargs=True)
                block._sp_diffusers_first_frame_hook = True


register_plan("HunyuanVideoTransformer3DModel", _hunyuan_video_plan, _prepare_hunyuan_video)
