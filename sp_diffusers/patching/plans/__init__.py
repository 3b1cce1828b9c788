"""Context-parallel plans for models diffusers ships without one, in diffusers' own declarative form, plus
the processor each needs to route attention through the dispatcher. One module per model, as ``patches/``.

A plan is diffusers' ``_cp_plan`` dict (which module inputs/outputs to split or gather along which dim)
and, where the model's attention processor calls SDPA directly (so no backend or parallel config can
reach it), a ``prepare(model)`` that swaps in a processor that computes the same function through
``dispatch_attention_fn``. ``sp_diffusers.install()`` attaches a plan only to classes whose installed
diffusers has none, and runs ``prepare`` before ``set_attention_backend`` / ``enable_parallelism``.
Users register plans for their own models with :func:`register_plan`.
"""

from __future__ import annotations

from . import cogvideox, hunyuan_video, hunyuan_video15, sd3, wan_vace, zimage  # noqa: F401  (each registers its plan)
from .assignments import ModelPlan, PlanStatus, attach, detach, prepare_model, register_plan, registered_plans
from .cogvideox import CogVideoXJointAttnProcessor
from .hunyuan_video import HunyuanVideoJointAttnProcessor
from .hunyuan_video15 import HunyuanVideo15KeyMaskAttnProcessor
from .sd3 import SD3JointAttnProcessor
from .zimage import ZImageRefinerAttnProcessor

__all__ = [
    "CogVideoXJointAttnProcessor",
    "HunyuanVideo15KeyMaskAttnProcessor",
    "HunyuanVideoJointAttnProcessor",
    "ModelPlan",
    "PlanStatus",
    "SD3JointAttnProcessor",
    "ZImageRefinerAttnProcessor",
    "attach",
    "detach",
    "prepare_model",
    "register_plan",
    "registered_plans",
]
