"""An opt-in CPU platform for verl 0.9.1: device ``cpu``, collectives on gloo, no-op sync/cache/profiler.

verl 0.9.1 ships CUDA, NPU and ROCm platforms only; on a machine without an accelerator its detection falls
back to "nvidia", so ``get_device_name()`` says "cuda" and ``get_nccl_backend()`` says "nccl". Registering
this class under "cpu" and setting ``VERL_PLATFORM=cpu`` lets verl's engines build and run on gloo ranks,
so a verl pipeline with the sp-diffusers engine can be debugged on a laptop and tested in CI.

Order matters: verl reads the device name when ``verl.workers.engine`` is imported (module-level
``device_name = get_device_name()``) and caches the platform for the process, so register first::

    os.environ["VERL_PLATFORM"] = "cpu"
    from sp_diffusers.integrations.verl.cpu import register_cpu_platform
    register_cpu_platform()
    import sp_diffusers.integrations.verl.plugin  # (also registers it by itself when VERL_PLATFORM=cpu)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

try:
    from verl.plugin.platform import PlatformBase, PlatformRegistry
except ImportError as err:  # pragma: no cover - exercised by tests/test_verl.py in a subprocess
    raise ImportError(
        f"sp_diffusers.integrations.verl.cpu needs verl ({err}); fix: pip install 'sp-diffusers[verl]' "
        "(verl==0.9.1, installed next to your torch build without verl's extras)"
    ) from err

PLATFORM_NAME = "cpu"

__all__ = ["PLATFORM_NAME", "PlatformCPU", "register_cpu_platform", "wants_cpu_platform"]


class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: gloo collectives, nothing to synchronise, cache or profile."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: an accelerator host must not silently fall back to CPU; VERL_PLATFORM=cpu opts in.
        return False

    def current_device(self) -> Any:
        # verl moves tensors with `.to(get_device_id())`; the int 0 would mean cuda:0, "cpu" is the CPU.
        return torch.cpu.current_device()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def wants_cpu_platform() -> bool:
    """True when the user opted in with ``VERL_PLATFORM=cpu``."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def register_cpu_platform() -> type[PlatformCPU]:
    """Register ``PlatformCPU`` under "cpu" (idempotent); select it with ``VERL_PLATFORM=cpu``.

    Call before anything resolves verl's platform (``import verl.workers.engine`` does).
    """
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU
