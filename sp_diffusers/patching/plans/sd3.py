"""SD3 / SD3.5 (``SD3Transformer2DModel``, MMDiT): diffusers ships no context-parallel plan for it.

The processor (``JointAttnProcessor2_0``) calls SDPA directly, out of reach of backends and context
parallelism, so the plan comes with a processor that computes the same function through the dispatcher.
"""

from __future__ import annotations

from typing import Any

import torch

from ._joint import attend, joint_sizes, text_key_mask
from .assignments import register_plan, swap_processors

__all__ = ["SD3JointAttnProcessor"]


class SD3JointAttnProcessor:
    """``JointAttnProcessor2_0`` (SD3 / SD3.5 MMDiT, incl. qk-norm and dual attention) through the dispatcher.

    Same function as diffusers' processor, but attention goes through ``dispatch_attention_fn`` with this
    processor's backend and parallel config, so ``ulysses_sdpa`` (or any backend) and context parallelism
    apply. Under a plan the image tokens ``[B, N/P, D]`` and the text tokens ``[B, T/P, D]`` are both
    sequence-sharded; each rank attends over ``cat([image_r, text_r])`` and the all-to-all gathers the keys
    as ``[image_0, text_0, image_1, text_1, ...]``.

    ``encoder_hidden_states_mask`` (``[B, T]`` bool over the global text length, passed through
    ``joint_attention_kwargs``) masks padded text keys, so text padded to a multiple of the SP degree gives
    exactly the unpadded result; the joint key mask is built in the all-to-all's key order.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:

        if attention_mask is not None:
            raise ValueError(
                "SD3JointAttnProcessor takes no attention_mask; pass encoder_hidden_states_mask [B, T] (text keys) "
                "through joint_attention_kwargs instead"
            )
        image_tokens = hidden_states.shape[1]
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, N, H, D]
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        mask = None
        if encoder_hidden_states is not None:
            text_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            text_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            text_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)
            if encoder_hidden_states_mask is not None:
                text_sizes, image_sizes = joint_sizes(
                    self._parallel_config,
                    ["context_embedder:0", "pos_embed:0"],
                    [encoder_hidden_states.shape[1], image_tokens],
                    query.device,
                )
                mask = text_key_mask(
                    encoder_hidden_states_mask, text_sizes, image_sizes, False, type(self).__name__
                )
        out = attend(self, query, key, value, mask)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image_out, text_out = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](image_out)), text_out


def _sd3_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        # the patch embedding adds absolute positions before the split, so each shard keeps its own
        "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "context_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_sd3(model: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    swap_processors(model, JointAttnProcessor2_0, SD3JointAttnProcessor)


register_plan("SD3Transformer2DModel", _sd3_plan, _prepare_sd3)
