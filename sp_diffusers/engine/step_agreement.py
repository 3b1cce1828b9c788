"""Before a backward, every rank agrees on what it is about to do: whether its loss_fn worked, and how many
samples its loss averages over (data-parallel ranks may hold different counts).

One small all-gather over the whole world per ``forward_backward``, on the engine's control group (gloo, also
beside NCCL: a CPU exchange that does not wait for the GPU). A rank whose loss_fn failed would
otherwise skip the backward while its peers enter the backward's collectives and wait there until the
process-group timeout; and a mean of per-rank means over unequal batches is not the mean over the samples
(1 and 3 samples: a 0.9 relative gradient error).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import collective_device
from .protocols import StepRunner

__all__ = ["StepError", "agree_step", "batch_size_of", "unpack_loss"]


class StepError(RuntimeError):
    """Another rank's step failed; this rank stops too so that no rank waits in a collective."""


def unpack_loss(result: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_fn``'s ``(loss, metrics)``, checked: a scalar tensor that requires grad, and a dict."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"loss_fn returned {type(result).__name__}; it must return (loss, metrics): loss a scalar tensor "
            "with grad, metrics a dict (may be empty)"
        )
    loss, metrics = result
    if not torch.is_tensor(loss):
        raise TypeError(
            f"loss_fn returned a loss of type {type(loss).__name__} ({loss!r}); it must be a torch tensor "
            "computed from the model's output (a Python float carries no gradient)"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)}; it must be a scalar: reduce it (e.g. "
            ".mean() over the batch)"
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require grad: it was computed without the model's output, "
            "under torch.no_grad(), or detached; fix: build it from engine.forward(...) inside loss_fn"
        )
    if not isinstance(metrics, dict):
        raise TypeError(f"loss_fn returned metrics of type {type(metrics).__name__}; it must be a dict")
    return loss.reshape(()), metrics


def batch_size_of(batch: Any) -> int | None:
    """The leading dim of a batch's first tensor (or the length of its first list), None when unknown."""
    if not isinstance(batch, dict):
        return None
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() >= 1:
            return int(value.shape[0])
    for value in batch.values():
        if isinstance(value, (list, tuple)) and value:
            return len(value)
    return None


def agree_step(engine: StepRunner, failure: BaseException | None, num_samples: int | None) -> float:
    """Share ``failure`` and ``num_samples`` with every rank; raise everywhere if any rank failed, else
    return this rank's loss weight ``n_local * dp / n_total`` (1.0 for equal or unknown counts)."""
    layout = engine.layout
    if not (dist.is_available() and dist.is_initialized()) or layout.world == 1:
        if failure is not None:
            raise failure
        return 1.0
    from ..parallel.gathers import gather_ints

    row = [int(failure is not None), -1 if num_samples is None else int(num_samples)]
    # the engine's control group: gloo beside NCCL, so this exchange never waits for the GPU to drain
    group = engine.control_group
    table = gather_ints(row, group, collective_device(group))
    failed = [rank for rank, r in enumerate(table) if r[0]]
    if failed:
        messages: list[str | None] = [None] * layout.world
        text = f"{type(failure).__name__}: {failure}" if failure is not None else None
        dist.all_gather_object(messages, text, group=group)
        if failure is not None:
            raise failure
        raise StepError(
            f"the loss_fn of rank {failed[0]} raised ({messages[failed[0]]}); rank {layout.rank} stops too"
            + (f" (failing ranks: {failed})" if len(failed) > 1 else "")
        )
    counts = [r[1] for r in table]
    if all(c < 0 for c in counts) or num_samples is None:
        return 1.0
    sp = layout.world // layout.dp  # SP groups are blocks of adjacent ranks (ulysses fastest, then ring)
    per_dp = [counts[d * sp : (d + 1) * sp] for d in range(layout.dp)]
    for d, group in enumerate(per_dp):
        if len(set(group)) > 1:
            raise ValueError(
                f"the ranks of SP group {d} hold different sample counts ({group}); every rank of an SP group "
                "must run the same micro-batch (FSDPEngine.prepare_batch broadcasts it)"
            )
    if any(group[0] < 0 for group in per_dp):
        raise ValueError(
            f"num_samples was given on some data-parallel ranks and not on others ({[g[0] for g in per_dp]}); "
            "pass it on every rank or on none"
        )
    total = sum(group[0] for group in per_dp)
    if total == 0:
        return 1.0
    return num_samples * layout.dp / total
