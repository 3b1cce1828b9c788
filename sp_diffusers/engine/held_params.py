"""Parameters gathered once for many forwards: a rollout's N denoising steps and the old log-probs it recomputes.

FSDP2 reshards every block after its forward, so N forwards all-gather the whole model N times. A rollout reads
the same weights at every step and computes no gradient, so inside :func:`held` each block keeps its full
weights after its first forward (``set_reshard_after_forward(False)``: the next forwards find them gathered and
issue nothing), and at the end every block is resharded and its setting restored: training gathers per block, as
before. The root module's own parameters (embeddings, the final norm and projection) stay gathered after a forward
anyway (FSDP2's rule for the root: a backward reshards them); :func:`release` reshards them too, for a model that
runs no backward next (a frozen expert would otherwise keep them gathered for good).

Holding costs the whole model in the compute dtype (:func:`gathered_bytes`); :func:`fits` says whether the device
has it to spare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["fits", "gathered_bytes", "held", "release"]

# what `fits` leaves free beside the held weights: the rollout's activations, the allocator's slack, a reward model
RESERVE_FRACTION = 0.25


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]


def _reshards_after_forward(module: torch.nn.Module) -> bool:
    groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[attr-defined]
    return any(g.post_forward_mesh_info is not None for g in groups)


def _reshards_after_backward(module: torch.nn.Module) -> bool:
    groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[attr-defined]
    return any(g.reshard_after_backward for g in groups)


@contextlib.contextmanager
def held(model: torch.nn.Module, backward: bool = False) -> Iterator[None]:
    """Inside: each FSDP block of ``model`` gathered at its first forward and kept; with ``backward``, kept through
    backward too (the root's own parameters as well): micro-steps of one optimizer step gather once, gradients are
    still reduce-scattered after each backward. After: every module resharded, its settings restored - before the
    optimizer steps the shards, whose gathered copies would then be stale."""
    blocks = _blocks(model)
    before = [_reshards_after_forward(b) for b in blocks]
    everyone = [model, *blocks] if backward else []
    before_bw = [_reshards_after_backward(m) for m in everyone]
    for b in blocks:
        b.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    for m in everyone:
        m.set_reshard_after_backward(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for b, value in zip(blocks, before, strict=True):
            b.set_reshard_after_forward(value, recurse=False)  # type: ignore[operator]
        for m, value in zip(everyone, before_bw, strict=True):
            m.set_reshard_after_backward(value, recurse=False)  # type: ignore[operator]
        release(model)


def release(model: torch.nn.Module) -> None:
    """Every FSDP module of ``model`` resharded, the root's own parameters included: only shards stay."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gathered_bytes(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Bytes of every parameter at full size in ``compute_dtype`` (None: its own): what holding them costs."""
    total = 0
    for p in model.parameters():
        size = torch.empty((), dtype=compute_dtype).element_size() if compute_dtype else p.element_size()
        total += p.numel() * size  # a DTensor's numel is the full parameter's
    return total


def _free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device``: the accelerator's, or the host's available memory for the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    info = {}
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


def fits(need: int, device: torch.device) -> bool:
    """Whether ``need`` more bytes fit on ``device`` with :data:`RESERVE_FRACTION` of its memory still free."""
    free, total = _free_bytes(device)
    return need <= free - RESERVE_FRACTION * total
