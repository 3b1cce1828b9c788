"""Wan-VACE (``WanVACETransformer3DModel``): Wan with a control branch; no plan in diffusers.

The VACE blocks run before the main blocks: each reads the (patch-embedded) video tokens and carries the control
stream, and returns a hint that a main block adds to its video tokens. Wan's processors already route attention
through the dispatcher, so the plan needs no processor swap.
"""

from __future__ import annotations

from .assignments import register_plan


def _wan_vace_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    def split(dims: int) -> ContextParallelInput:
        return ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False)

    return {
        # (cos, sin) [1, N, 1, D]: one row per video token, in token order (as Wan's plan)
        "rope": {
            0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True),
            1: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True),
        },
        # Every VACE block reads the forward's (whole) video tokens: each splits its own copy. The control stream
        # (zero-padded to the video length by the model) is split once and flows on sharded; the hints come out
        # sharded like the video tokens they are added to.
        "vace_blocks.*": {"hidden_states": split(3)},
        "vace_blocks.0": {"control_hidden_states": split(3)},
        "blocks.0": {"hidden_states": split(3)},
        # The text (and I2V image) context stays whole: each rank's video queries attend to all of it (the image
        # tokens are told apart by position, which a split would break; see patches/wan_text_split.py)
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


register_plan("WanVACETransformer3DModel", _wan_vace_plan)
