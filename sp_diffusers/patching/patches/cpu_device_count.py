"""``enable_parallelism`` crashes on a CPU-only host.

Defect: ``ModelMixin._resolve_parallel_config`` picks the device as
``rank % torch.accelerator.device_count()``; without an accelerator the count is 0 and the call dies with
``ZeroDivisionError``, so context parallelism cannot run on CPU (gloo) at all.
Affected: diffusers 0.42.x (the method first appears there; 0.36-0.41 ask ``torch.get_device_module``,
which counts the CPU as one device). Upstream: no issue filed as of 2026-11.
Fix: while that method runs on a host without an accelerator, ``torch.accelerator.device_count()``
reports 1 (the CPU), which is what older releases computed.
A CUDA build of torch on a host without the NVIDIA driver (a CPU login node, a CI runner: PyPI's Linux x86_64
torch is such a build) has no accelerator either; there torch 2.7-2.10's ``device_count()`` raises ("Found
no NVIDIA driver on your system") where 2.11+ return 0: both count as 0 here.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "cpu_device_count"
AFFECTED = "0.42"
UPSTREAM = "none filed (diffusers 0.42 `_resolve_parallel_config`)"

_swaps = AttributeSwaps()


def _target():
    from diffusers.models.modeling_utils import ModelMixin

    return ModelMixin, getattr(ModelMixin, "_resolve_parallel_config", None)


def _device_count(count=None) -> int:
    """``torch.accelerator.device_count()`` (or ``count()``); 0 where it raises: a CUDA build without a driver."""
    try:
        return (count or torch.accelerator.device_count)()
    except RuntimeError:
        return 0


def probe() -> Probe:
    _, fn = _target()
    if fn is None:
        return Probe(
            False, "no ModelMixin._resolve_parallel_config (device chosen via torch.get_device_module)"
        )
    if "torch.accelerator.device_count()" not in inspect.getsource(fn):
        return Probe(False, "_resolve_parallel_config does not divide by torch.accelerator.device_count()")
    count = _device_count()
    if count > 0:
        return Probe(False, f"this host has {count} accelerator(s)")
    return Probe(True, "rank % torch.accelerator.device_count() divides by zero on this CPU-only host")


@contextlib.contextmanager
def _cpu_counts_as_one_device():
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(1, _device_count(original))
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def apply() -> None:
    if _swaps.active:
        return
    owner, original = _target()
    if original is None:
        return

    def _resolve_parallel_config(self, config):
        with _cpu_counts_as_one_device():
            return original(self, config)

    _resolve_parallel_config.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(owner, "_resolve_parallel_config", _resolve_parallel_config)
    logger.info("patched ModelMixin._resolve_parallel_config: CPU-only hosts count as one device")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
