"""CogVideoX 1.0 / 1.5 (``CogVideoXTransformer3DModel``): no plan in diffusers, and a processor that calls
SDPA directly; the plan comes with a dispatcher-routed processor and a text key mask for padded text.
"""

from __future__ import annotations

from typing import Any

import torch

from ...parallel.cp_groups import cp_world
from ._joint import attend, joint_sizes, text_key_mask
from .assignments import register_plan, swap_processors

__all__ = ["CogVideoXJointAttnProcessor"]


class CogVideoXJointAttnProcessor:
    """``CogVideoXAttnProcessor2_0`` (CogVideoX 1.0 / 1.5 joint text-video attention) through the dispatcher.

    Same function as diffusers' processor (which calls SDPA directly, out of reach of backends and context
    parallelism): per rank the joint sequence is ``cat([text_r, video_r])`` (``[B, T/P + N/P, H, D]``), q/k get
    LayerNorm over the head dim, RoPE rotates the video part only (tables ``[N/P, D]``, split by the plan like
    the video tokens), and the all-to-all orders the keys ``[text_0, video_0, text_1, video_1, ...]``.

    CogVideoX has no text mask. Text that does not divide the SP degree is padded (zeros) and the padded keys
    masked: pass ``attention_kwargs={"encoder_hidden_states_mask": mask}`` (``[B, T]`` bool over the padded
    length) to the model, which hands it to every block's attention; the result equals the unpadded model's.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        world = cp_world(self._parallel_config)
        text_local, video_local = encoder_hidden_states.shape[1], hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # [B, T/P + N/P, C]
        batch, length, _ = hidden_states.shape

        mask = None
        if attention_mask is not None:
            if encoder_hidden_states_mask is not None or world > 1:
                raise ValueError(
                    "CogVideoXJointAttnProcessor: attention_mask is only honoured without context parallelism "
                    "and without encoder_hidden_states_mask (got "
                    f"{world} sequence shards, encoder_hidden_states_mask "
                    f"{'set' if encoder_hidden_states_mask is not None else 'None'}); fix: mask padded text "
                    "with encoder_hidden_states_mask [B, T] in attention_kwargs"
                )
            # what diffusers' processor does with it: a per-head [B, H, S_q, S_kv] mask
            mask = attn.prepare_attention_mask(attention_mask, length, batch)
            mask = mask.view(batch, attn.heads, -1, mask.shape[-1])
        elif encoder_hidden_states_mask is not None:
            text_sizes, video_sizes = joint_sizes(
                self._parallel_config,
                ["transformer_blocks.0:encoder_hidden_states", "transformer_blocks.0:hidden_states"],
                [text_local, video_local],
                hidden_states.device,
            )
            mask = text_key_mask(
                encoder_hidden_states_mask, text_sizes, video_sizes, True, type(self).__name__
            )

        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, S, H, D]
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)  # LayerNorm over D: per token and head, layout-independent
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            # RoPE on the video tokens only (text keeps no position), as diffusers' in-place slice assignment
            query = torch.cat(
                [
                    query[:, :text_local],
                    apply_rotary_emb(query[:, text_local:], image_rotary_emb, sequence_dim=1),
                ],
                dim=1,
            )
            if not attn.is_cross_attention:
                key = torch.cat(
                    [
                        key[:, :text_local],
                        apply_rotary_emb(key[:, text_local:], image_rotary_emb, sequence_dim=1),
                    ],
                    dim=1,
                )

        out = attend(self, query, key, value, mask)  # [B, S, H * D]
        out = attn.to_out[1](attn.to_out[0](out))
        text_out, video_out = out.split([text_local, length - text_local], dim=1)
        return video_out, text_out


def _cogvideox_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    # CogVideoXPatchEmbed embeds text and video together into one [B, T + N, C] sequence (adding sincos positions
    # on CogVideoX-2b), and the model then slices it into the two streams with the global text length. So the
    # streams are split where they enter the first block, each along its own sequence dim (a split of the joint
    # sequence would cut it at the wrong place for every rank but the first).
    return {
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        # RoPE (CogVideoX-5b, 1.5) arrives as a model input, (cos, sin) [N, D] in video-token order, and is
        # handed unchanged to every block: split it at each block like the video tokens (None on CogVideoX-2b).
        "transformer_blocks.*": {
            "image_rotary_emb": [
                ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),
                ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),
            ],
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_cogvideox(model: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    swap_processors(model, CogVideoXAttnProcessor2_0, CogVideoXJointAttnProcessor)


register_plan("CogVideoXTransformer3DModel", _cogvideox_plan, _prepare_cogvideox)
