"""Imported once by the fork server that starts test ranks (tests/_dist.py): the libraries every rank needs,
so that no rank spends seconds importing them. Libraries only: no sp_diffusers, no process group, no state."""

import diffusers
import torch
import torch.distributed  # noqa: F401
import transformers  # noqa: F401

# diffusers resolves its classes lazily: resolve the ones the tests build, so that ranks find them imported
for _name in (
    "QwenImageTransformer2DModel",
    "FluxTransformer2DModel",
    "WanTransformer3DModel",
    "SD3Transformer2DModel",
    "AutoencoderKLQwenImage",
    "FlowMatchEulerDiscreteScheduler",
):
    getattr(diffusers, _name, None)
