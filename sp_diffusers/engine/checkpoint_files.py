"""The on-disk format of sp-diffusers checkpoints: folders, ``meta.json``, ``latest``, RNG files.

Layout of a checkpoint root::

    root/
      step-00000010/          complete checkpoints only (renamed into place after every rank wrote)
        .metadata, __0_0.distcp, ...   DCP shards: model + optimizer
        meta.json             format, step, layout (dp, ring, ulysses), model class, config and LoRA fingerprints
        trainer.pt            LR scheduler and extra state (rank 0)
        rng-rank00000.pt ...  per-rank RNG state
      latest                  name of the newest complete checkpoint (replaced atomically)
      .tmp-step-00000010/     a checkpoint being written; never read, removed by the next save

A crash at any point leaves the previous checkpoint and ``latest`` untouched: a partial checkpoint is
only ever in a ``.tmp-*`` folder, and ``os.replace`` of the folder and of ``latest`` is atomic on POSIX.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from .settings import LoraSettings

META = "meta.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
# 2: LoRA fingerprint (rank, alpha, targets, init) in meta.json. Format 1 (no LoRA details) still loads.
FORMAT = 2

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointMeta",
    "checkpoint_dir_for",
    "find_latest",
    "lora_fingerprint",
    "model_fingerprint",
    "read_meta",
    "write_latest",
    "write_meta",
]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here; the message names what differs and the fix."""


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    dp: int
    ring: int
    ulysses: int
    model_class: str
    model_fingerprint: str
    lora: bool
    format: int = FORMAT
    lora_fingerprint: str = ""  # "" in format 1 (and without LoRA)


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the model's config (or parameter names and shapes when it has none)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "items"):
        text = json.dumps(
            {k: v for k, v in dict(config).items() if not k.startswith("_")}, sort_keys=True, default=str
        )
    else:
        text = json.dumps([(n, list(p.shape)) for n, p in model.named_parameters()])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def lora_fingerprint(lora: LoraSettings | None) -> str:
    """What the adapters' shapes and function depend on: rank, alpha, target modules, init ("" without LoRA)."""
    if lora is None:
        return ""
    text = json.dumps([lora.rank, float(lora.alpha), sorted(lora.target_modules), str(lora.init)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def checkpoint_dir_for(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (via ``latest``), or None when there is none."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / META).exists():
        raise CheckpointError(
            f"{pointer} names {path.name}, which is not a complete checkpoint (no {META}); "
            f"fix: point {pointer} at an existing step-* folder or delete it to start fresh"
        )
    return path


def read_meta(path: Path) -> CheckpointMeta:
    try:
        data = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path / META} is unreadable or corrupt ({err}); fix: load an earlier step"
        ) from err
    version = data.get("format") if isinstance(data, dict) else None
    if version not in (1, FORMAT):
        raise CheckpointError(
            f"{path / META} has format {version!r}; this sp-diffusers reads formats 1 and {FORMAT}; fix: load it "
            "with the sp-diffusers version that wrote it (a newer one), or an earlier step"
        )
    try:
        return CheckpointMeta(**data)
    except TypeError as err:
        raise CheckpointError(f"{path / META} is corrupt ({err}); fix: load an earlier step") from err


def write_meta(path: Path, meta: CheckpointMeta) -> None:
    (path / META).write_text(json.dumps(asdict(meta), indent=2))


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def remove_stale_tmp(root: Path) -> None:
    """Leftovers of an interrupted save (rank 0 only)."""
    for p in root.glob(f"{TMP_PREFIX}step-*"):
        shutil.rmtree(p, ignore_errors=True)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)


def agree(error: str | None, what: str, group: dist.ProcessGroup | None = None, fix: str = "") -> None:
    """Every rank learns whether any rank failed at ``what`` and raises the same ``CheckpointError`` (a rank
    that fails alone would otherwise leave its peers waiting in the next barrier).

    ``group``: the world's ranks, ideally on a gloo group (the engine's ``control_group``): the exchange is
    then a CPU one; on NCCL torch stages the pickled errors through the current CUDA device. ``fix``: what the
    message ends with.
    """
    errors = [error]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        tail = f"; fix: {fix}" if fix else ""
        raise CheckpointError(f"{what} failed on rank {rank} (of {len(failed)} failing): {message}{tail}")
