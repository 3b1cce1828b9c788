"""HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``): no plan in diffusers.

Every block is dual-stream: the video tokens and one context stream (the image, byT5 and MLLM tokens, reordered
valid-first by the model, with one key mask) attend jointly. diffusers' processor routes attention through the
dispatcher, but builds a square query-and-key mask from the context mask, which a sequence split cannot carry
(the pairs of two ranks' tokens are on neither rank); the plan comes with a processor that passes a key mask.
"""

from __future__ import annotations

from typing import Any

import torch

from ._joint import attend
from .assignments import register_plan, swap_processors

__all__ = ["HunyuanVideo15KeyMaskAttnProcessor"]


class HunyuanVideo15KeyMaskAttnProcessor:
    """``HunyuanVideo15AttnProcessor2_0`` with a key mask instead of its square mask.

    diffusers' processor turns the context mask ``[B, T]`` into ``[B, 1, S, S] = key & query`` over the joint
    sequence ``[video, context]``. Masking the padded *queries* changes only the padded context rows (they
    attend to nothing and give 0): those rows are masked keys in every later attention and never reach the
    output, so a key mask ``[B, 1, 1, S]`` gives the same output and the same gradients for every parameter.
    Under the plan each rank holds ``[video_r, context_r]`` and a local key mask, which the backend all-gathers
    in the all-to-all's key order. Without parallelism this is diffusers' processor up to those padded rows.
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
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # [B, S, H, D]

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:  # RoPE on the video tokens only
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        context = 0
        if encoder_hidden_states is not None:
            context = encoder_hidden_states.shape[1]
            context_query = heads(attn.add_q_proj(encoder_hidden_states))
            context_key = heads(attn.add_k_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                context_query = attn.norm_added_q(context_query)
            if attn.norm_added_k is not None:
                context_key = attn.norm_added_k(context_key)
            query = torch.cat([query, context_query], dim=1)
            key = torch.cat([key, context_key], dim=1)
            value = torch.cat([value, heads(attn.add_v_proj(encoder_hidden_states))], dim=1)

        mask = None
        if attention_mask is not None:
            # [B, T] context mask -> [B, 1, 1, S] over [video, context]: the video keys are always valid
            video = query.shape[1] - attention_mask.shape[1]
            mask = torch.nn.functional.pad(attention_mask.bool(), (video, 0), value=True)[:, None, None, :]
        out = attend(self, query, key, value, mask)
        if encoder_hidden_states is None:
            return out, None
        out, context_out = out[:, : out.shape[1] - context], out[:, out.shape[1] - context :]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            context_out = attn.to_add_out(context_out)
        return out, context_out


def _hunyuan_video15_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    def split(dims: int, dim: int = 1, output: bool = False) -> ContextParallelInput:
        return ContextParallelInput(split_dim=dim, expected_dims=dims, split_output=output)

    # Split at the first block: the model builds the context stream (three embedders, then a valid-first
    # reorder per sample) from the whole prompts, so the token refiner and the reorder run on every rank.
    return {
        "transformer_blocks.0": {"hidden_states": split(3), "encoder_hidden_states": split(3)},
        # every block reads the forward's (whole) context mask [B, T]: each splits its own copy, as the context
        "transformer_blocks.*": {"attention_mask": split(2)},
        # (cos, sin) [N, D]: one row per video token
        "rope": {0: split(2, dim=0, output=True), 1: split(2, dim=0, output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_hunyuan_video15(model: torch.nn.Module) -> None:
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    swap_processors(model, HunyuanVideo15AttnProcessor2_0, HunyuanVideo15KeyMaskAttnProcessor)


register_plan("HunyuanVideo15Transformer3DModel", _hunyuan_video15_plan, _prepare_hunyuan_video15)
