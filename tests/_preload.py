"""Imported once by the fork server that starts test ranks (tests/_dist.py): the libraries every rank needs,
so that no rank spends seconds importing them. Libraries only: no sp_diffusers, no process group, no state.
A fork server of the compatibility matrix names its diffusers' folder in ``SP_TEST_SYS_PATH``."""

import importlib.util
import os
import sys

sys.path[:0] = [p for p in os.environ.get("SP_TEST_SYS_PATH", "").split(os.pathsep) if p]

import diffusers  # noqa: E402
import torch  # noqa: E402
import torch.distributed  # noqa: E402, F401
import transformers  # noqa: E402, F401

# what importing verl costs a rank most (verl itself is never preloaded: importing it installs sp-diffusers)
if importlib.util.find_spec("datasets") is not None:
    import datasets  # noqa: F401

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
