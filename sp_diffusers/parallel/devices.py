"""Where the tensors the library creates live, and where a process group's collectives run.

One source for three facts every layer needs (comm, engine, trainer, integrations, the demo):

- :func:`collective_device` - the device a tensor must be on for a collective on a given group: the current
  CUDA device for NCCL, the CPU for gloo (and for groups that carry CPU tensors beside others). It is read
  when called, never stored: a device captured when an object was built goes stale when the process later
  selects another GPU, and NCCL then meets two ranks on one GPU.
- :func:`default_device` / :func:`use_device` - the compute device of this process (``cuda:LOCAL_RANK``
  with a GPU, else the CPU) and making it the current one, so that torch's own object collectives
  (``all_gather_object`` reads ``torch.cuda.current_device()``) agree with ours.
- :func:`to_device` - a batch (tensors, lists and tuples of them, dicts) on a device; host-to-device copies
  are queued without a host sync. :func:`fetch_scalars` - the other way: a step's metrics read in one
  transfer.

:func:`host_subgroups` builds gloo groups beside an NCCL world for the engine's small agreements (did every
rank's step work, which keys a batch has): on them an agreement is a CPU exchange that never waits for the
GPU to drain.

Nothing here imports the rest of the package (it sits below ``comm``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "collective_device",
    "default_device",
    "device_of",
    "fetch_scalars",
    "host_subgroups",
    "needs_host_groups",
    "to_device",
    "use_device",
]

# backends whose collectives move CPU tensors (a group on one of these needs no host-side twin)
_CPU_BACKENDS = ("gloo", "fake", "mpi")


def _backend(group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(group)).lower()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must be on for a collective on ``group`` (None: the default group), read now.

    NCCL (and other accelerator backends): the current device of that accelerator. gloo, the fake group, a
    mixed ``cpu:gloo,cuda:nccl`` group, or no process group at all: the CPU.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = _backend(group)
    if any(name in backend for name in _CPU_BACKENDS):
        return torch.device("cpu")
    device_type = _accelerator_of(backend)
    module = torch.get_device_module(device_type)
    return torch.device(device_type, module.current_device())


def _accelerator_of(backend: str) -> str:
    for device_type, name in dist.Backend.default_device_backend_map.items():
        if name == backend and device_type != "cpu":
            return device_type
    return "cuda"


def needs_host_groups(group: dist.ProcessGroup | None = None) -> bool:
    """True when collectives on ``group`` cannot carry CPU tensors (NCCL): small host-side agreements then
    go through :func:`host_subgroups` instead of a device round trip."""
    return dist.is_available() and dist.is_initialized() and collective_device(group).type != "cpu"


def host_subgroups(partition: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """gloo groups over the blocks of ``partition`` (a list of rank lists covering the world); this rank's
    group, or None when this rank is in none of them. Collective: every rank calls it with the same partition.
    """
    mine, _ = dist.new_subgroups_by_enumeration([list(p) for p in partition], backend="gloo")
    return mine


def default_device() -> torch.device:
    """This process's compute device: ``cuda:LOCAL_RANK`` with a GPU (ranks beyond the visible GPUs share
    them round-robin, as gloo ranks sharing one GPU do), else the CPU. Read from the environment when called."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local = os.environ.get("LOCAL_RANK")
    index = int(local) % count if local is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator device (a no-op for the CPU and meta)."""
    if device.type not in ("cpu", "meta") and device.index is not None:
        torch.get_device_module(device.type).set_device(device)


def device_of(*values: Any, default: torch.device | str = "cpu") -> torch.device:
    """The device of the first tensor among ``values`` (searching lists, tuples and dicts), else ``default``."""
    found = _first_tensor(values)
    return found.device if found is not None else torch.device(default)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if torch.is_tensor(value):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor (also inside lists, tuples and dicts) on ``device``; other values as they are.

    Copies to an accelerator are queued (``non_blocking``): from pageable host memory CUDA stages the bytes
    before returning, so the source may change afterwards and no host sync happens. Copies to the CPU block
    (a non-blocking device-to-host copy could be read before it lands).
    """
    if torch.is_tensor(value):
        if value.device == device:
            return value
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(torch.is_tensor(v) for v in value):
        moved = [to_device(v, device) for v in value]
        return moved if isinstance(value, list) else tuple(moved)
    return value


def fetch_scalars(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every one-element tensor (also inside a list or tuple value) as a Python float, read in
    one device-to-host transfer per device: one host sync for a whole step's metrics, not one per metric.
    Other values are returned as they are."""
    slots: dict[torch.device, list[tuple[str, int | None, torch.Tensor]]] = {}
    for key, value in values.items():
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, item in items:
            if torch.is_tensor(item) and item.numel() == 1:
                slots.setdefault(item.device, []).append((key, index, item))
    out = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}
    for found in slots.values():
        numbers = torch.stack([t.detach().reshape(()).to(torch.float64) for _, _, t in found]).tolist()
        for (key, index, _), number in zip(found, numbers, strict=True):
            if index is None:
                out[key] = number
            else:
                out[key][index] = number
    return out
