"""Z-Image (``ZImageTransformer2DModel``, S3-DiT: Turbo, Base, Omni): no plan in diffusers.

The model refines the image tokens and the caption (and, in Omni mode, SigLIP tokens) separately, then joins
them per sample into one sequence for the main layers (``[image, caption]``; Omni ``[caption, image, siglip]``),
pads the batch to one length with a key mask, and reads the image tokens of each sample back after the final
layer. The plan splits that joined sequence where it enters the main layers and gathers the final layer's
output; the refiners run before the split on the whole (short) streams on every rank, with local attention.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .assignments import register_plan

__all__ = ["ZImageRefinerAttnProcessor"]


class ZImageRefinerAttnProcessor:
    """diffusers' ``ZSingleStreamAttnProcessor`` for the refiners, which never see a split sequence.

    ``enable_parallelism`` hands every attention processor of the model the context-parallel config; the
    refiners run before the plan's split, on the whole image / caption stream on every rank, so their attention
    must stay local. This processor ignores the config (the attribute reads None whatever is assigned) and
    otherwise runs diffusers' processor unchanged: without parallelism it is diffusers' processor, bit for bit.
    """

    _attention_backend = None

    @property
    def _parallel_config(self) -> None:
        return None

    @_parallel_config.setter
    def _parallel_config(self, value: Any) -> None:
        pass  # the refiners attend locally: see the class docstring

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

        return ZSingleStreamAttnProcessor.__call__(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis
        )


def _zimage_plan(final_layers: tuple[str, ...] = ("2-1",)) -> dict:
    """The plan; ``final_layers`` are the keys of the model's ``all_final_layer`` (``"{patch}-{f_patch}"``),
    one per patch size it was built for (the forward uses one of them)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    def split(dims: int) -> ContextParallelInput:
        return ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False)

    # every main layer reads the forward's (whole) key mask [B, L] and RoPE table [B, L, D/2] (complex): each
    # splits its own copy along the joined sequence, as the tokens; the tokens are split once, at layers.0
    per_layer = {"attn_mask": split(2), "freqs_cis": split(3)}
    final: dict[str, Any] = {}
    if "noise_mask" in inspect.signature(ZImageTransformerBlock.forward).parameters:
        # Omni (0.37+): a per-token noisy / clean selector [B, L] for the layers' and the final layer's
        # modulation (None, and so skipped, in the plain mode)
        per_layer["noise_mask"] = split(2)
        final = {"noise_mask": split(2)}
    plan: dict[str, Any] = {"layers.0": {"x": split(3)}, "layers.*": per_layer}
    for key in final_layers:
        if final:
            plan[f"all_final_layer.{key}"] = dict(final)
        plan[f"all_final_layer.{key}.linear"] = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return plan


def _prepare_zimage(model: torch.nn.Module) -> None:
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    # the final layers are a ModuleDict keyed by patch size, which diffusers' "*" (ModuleList only) cannot
    # address: this model's plan names its own
    model._cp_plan = _zimage_plan(tuple(model.all_final_layer.keys()))
    for refiners in (model.noise_refiner, model.context_refiner, getattr(model, "siglip_refiner", None)):
        for block in refiners or ():
            if type(block.attention.processor) is ZSingleStreamAttnProcessor:
                block.attention.set_processor(ZImageRefinerAttnProcessor())


register_plan("ZImageTransformer2DModel", _zimage_plan, _prepare_zimage)
