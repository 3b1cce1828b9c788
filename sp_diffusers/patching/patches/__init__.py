"""One module per upstream defect (diffusers, and verl-omni where it is installed); ``sp_diffusers.install()``
applies those the installed code needs, in this order, and ``uninstall()`` reverts them in reverse.

Each module has: a docstring (defect, affected versions, upstream reference), ``NAME``, ``AFFECTED``,
``UPSTREAM``, ``probe() -> Probe``, ``apply()``, ``revert()`` and ``is_applied()``; apply and revert are
idempotent. Importing a patch module changes nothing.
"""

from __future__ import annotations

from . import (
    backend_leak,
    cpu_device_count,
    helios_plan,
    ltx2_plan,
    mesh_injection,
    native_ulysses,
    per_token_timestep,
    plan_optional_inputs,
    qwenimage_joint_mask,
    root_hook_return_dict,
    uneven_sharding,
    verl_omni_attn_backend,
    verl_omni_cpu_engine,
    verl_omni_min_diffusers,
    verl_omni_qwen_mask,
    wan_text_split,
)
from ._base import Probe

ALL_PATCHES = (
    cpu_device_count,
    root_hook_return_dict,
    uneven_sharding,
    mesh_injection,
    qwenimage_joint_mask,
    backend_leak,
    native_ulysses,
    # the shipped plans that are wrong for training, and the hook defect their fixes need
    plan_optional_inputs,
    per_token_timestep,
    wan_text_split,
    ltx2_plan,
    helios_plan,
    # verl-omni's code, fixed when its modules are imported; after mesh_injection and qwenimage_joint_mask,
    # whose state two of them read
    verl_omni_attn_backend,
    verl_omni_cpu_engine,
    verl_omni_min_diffusers,
    verl_omni_qwen_mask,
)

__all__ = ["ALL_PATCHES", "Probe"]
