"""Moved to :mod:`sp_diffusers.integrations.verl.cpu`; this name stays for one release."""

from __future__ import annotations

import warnings

from .verl.cpu import register_cpu_platform, wants_cpu_platform

__all__ = ["register_cpu_platform", "wants_cpu_platform"]

warnings.warn(
    "sp_diffusers.integrations.verl_cpu moved to sp_diffusers.integrations.verl.cpu; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
