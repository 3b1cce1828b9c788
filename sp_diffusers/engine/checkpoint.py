"""Atomic, resumable checkpoints of an ``FSDPEngine`` with ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint root::

    root/
      step-00000010/          complete checkpoints only (renamed into place after every rank wrote)
        .metadata, __0_0.distcp, ...   DCP shards: model + optimizer
        meta.json             step, layout (dp, ring, ulysses), model class and config fingerprint
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

from ..model_kinds import class_name

if TYPE_CHECKING:  # pragma: no cover
    from .fsdp_engine import FSDPEngine

META = "meta.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "checkpoint_dir_for",
    "find_latest",
    "load_checkpoint",
    "read_meta",
    "save_checkpoint",
    "write_latest",
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
    format: int = 1


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
        return CheckpointMeta(**data)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(
            f"{path / META} is unreadable or corrupt ({err}); fix: load an earlier step"
        ) from err


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


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------------------ engine state


def _state(engine: FSDPEngine) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=StateDictOptions())
    return {"model": model_sd, "optimizer": optim_sd}


def engine_meta(engine: FSDPEngine, step: int) -> CheckpointMeta:
    layout = engine.layout
    return CheckpointMeta(
        step=step,
        dp=layout.dp,
        ring=layout.ring,
        ulysses=layout.ulysses,
        model_class=class_name(engine.model),
        model_fingerprint=model_fingerprint(engine.model),
        lora=engine.lora is not None,
    )


def save_checkpoint(
    engine: FSDPEngine, root: str | os.PathLike, step: int | None = None, extra: dict | None = None
) -> Path:
    """Write ``root/step-XXXXXXXX`` atomically (tmp folder, then rename) and point ``latest`` at it."""
    import torch.distributed.checkpoint as dcp

    rank, world = engine.layout.rank, engine.layout.world
    step = engine.global_step if step is None else step
    root = Path(root)
    final = checkpoint_dir_for(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(root)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(_state(engine), checkpoint_id=str(tmp), no_dist=world == 1)
    torch.save(rng_state(), tmp / f"rng-rank{rank:05d}.pt")
    if rank == 0:
        torch.save(
            {
                "lr_scheduler": engine.lr_scheduler.state_dict(),
                "global_step": engine.global_step,
                "extra": extra or {},
            },
            tmp / "trainer.pt",
        )
    barrier()
    if rank == 0:
        # meta.json last: its presence marks a complete checkpoint, then the rename publishes it
        write_meta(tmp, engine_meta(engine, step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_latest(root, final.name)
    barrier()
    return final


def _layout_text(m: CheckpointMeta) -> str:
    return f"dp={m.dp} x ring={m.ring} x ulysses={m.ulysses}"


def load_checkpoint(engine: FSDPEngine, path: str | os.PathLike) -> dict[str, Any]:
    """Load ``path`` (a step folder, or a root whose ``latest`` names one) into ``engine``; returns ``extra``.

    Refuses a checkpoint from another model, another SP/DP layout or with/without LoRA, naming the
    difference; the model, optimizer, LR scheduler, step and each rank's RNG come back exactly.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    if not (path / META).exists():
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"no checkpoint at {path} (no {META} and no '{LATEST}')")
        path = latest
    meta = read_meta(path)
    mine = engine_meta(engine, meta.step)
    if _layout_text(meta) != _layout_text(mine):
        raise CheckpointError(
            f"checkpoint {path} was written with layout {_layout_text(meta)} but this run has "
            f"{_layout_text(mine)}; fix: resume with the layout (process count and "
            "ulysses_sequence_parallel_size) it was written with"
        )
    for field_name in ("model_class", "model_fingerprint", "lora"):
        theirs, ours = getattr(meta, field_name), getattr(mine, field_name)
        if theirs != ours:
            raise CheckpointError(
                f"checkpoint {path} has {field_name}={theirs!r} but this run has {field_name}={ours!r}; fix: "
                "resume with the same model and layout the checkpoint was written with"
            )
    try:
        stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: {err}") from err
    # Loading replaces the optimizer state: start from none, so every parameter gets a placeholder to load
    # into (an engine that already stepped has no state for parameters that never had a gradient).
    engine.zero_grad()
    engine.optimizer.state.clear()
    state = _state(engine)
    missing = [k for k in state["model"] if f"model.{k}" not in stored]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} model tensors (e.g. {missing[:3]}); it was written for "
            "another model or is incomplete"
        )
    # A parameter that never had a gradient has no AdamW state in the checkpoint; the fresh optimizer
    # got a placeholder state from get_state_dict, which is dropped again so the optimizer is as saved.
    stateless = {
        fqn for fqn in state["optimizer"].get("state", {}) if f"optimizer.state.{fqn}.step" not in stored
    }
    try:
        dcp.load(
            state,
            checkpoint_id=str(path),
            planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
            no_dist=engine.layout.world == 1,
        )
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: {err}") from err
    set_state_dict(
        engine.model,
        engine.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(),
    )
    params = dict(engine.model.named_parameters())
    for fqn in stateless:
        engine.optimizer.state.pop(params[fqn], None)
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    engine.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
    engine.global_step = int(trainer["global_step"])
    rng_file = path / f"rng-rank{engine.layout.rank:05d}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    barrier()
    return trainer.get("extra", {})
