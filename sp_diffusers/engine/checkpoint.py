"""Atomic, resumable checkpoints of an ``FSDPEngine`` with ``torch.distributed.checkpoint`` (DCP).

The folder layout and ``meta.json`` are in ``checkpoint_files.py``. What this module guarantees:

- **Atomic.** A checkpoint is written into ``.tmp-step-N`` and renamed into place after every rank wrote;
  ``latest`` is replaced atomically. A crash leaves the previous checkpoint and ``latest`` untouched.
- **Fails together.** A rank that cannot write (read-only root, full disk) does not leave its peers waiting:
  after each phase every rank learns whether any rank failed and all raise the same ``CheckpointError``; the
  partial folder is removed.
- **Transactional load, in place.** Everything is checked (format, model, LoRA, every tensor's shape, the
  trainer state) before anything changes. The tensors then load in place (the device never holds a second
  copy of the model); the parameters' previous values wait in host memory, and the previous optimizer state
  stays referenced, so a load that fails inside DCP (a corrupt shard) puts both back: the engine is as it was.
- **Any layout.** FSDP2 + DCP reshard: a checkpoint written under one ``(dp, ring, ulysses)`` loads under any
  other that fits the world (2 -> 4 -> 1 ranks). Per-rank RNG states load where the rank existed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..families.kinds import class_name
from .checkpoint_files import (
    LATEST,
    META,
    TMP_PREFIX,
    CheckpointError,
    CheckpointMeta,
    agree,
    barrier,
    checkpoint_dir_for,
    find_latest,
    lora_fingerprint,
    model_fingerprint,
    read_meta,
    remove_stale_tmp,
    rng_state,
    set_rng_state,
    write_latest,
    write_meta,
)
from .protocols import TrainState

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "engine_meta", "find_latest", "load_checkpoint", "save_checkpoint"]


def _dcp_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException  # a BaseException, not an Exception: it must be named to be caught


def _failure(fn: Any) -> str | None:
    """Run ``fn``; its error as text (None when it worked). KeyboardInterrupt and friends still propagate."""
    try:
        fn()
    except (Exception, _dcp_exception()) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _state(engine: TrainState) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=StateDictOptions())
    state = {"model": model_sd, "optimizer": optim_sd}
    if getattr(engine, "ema", None) is not None:  # the parameters' moving average (engine/ema.py), sharded alike
        state["ema"] = engine.ema.state_dict()
    return state


def engine_meta(engine: TrainState, step: int) -> CheckpointMeta:
    layout = engine.layout
    return CheckpointMeta(
        step=step,
        dp=layout.dp,
        ring=layout.ring,
        ulysses=layout.ulysses,
        model_class=class_name(engine.model),
        model_fingerprint=model_fingerprint(engine.model),
        lora=engine.lora is not None,
        lora_fingerprint=lora_fingerprint(engine.lora),
    )


def save_checkpoint(
    engine: TrainState, root: str | os.PathLike, step: int | None = None, extra: dict | None = None
) -> Path:
    """Write ``root/step-XXXXXXXX`` atomically (tmp folder, then rename) and point ``latest`` at it."""
    import torch.distributed.checkpoint as dcp

    rank, world = engine.layout.rank, engine.layout.world
    step = engine.global_step if step is None else step
    root = Path(root)
    final = checkpoint_dir_for(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(root)
        tmp.mkdir(parents=True)

    # what every failed save ends with: the previous checkpoint is intact and resuming starts from it
    fix = f"make {root} a writable folder with free space, then run again: it resumes from the newest checkpoint"
    agree(
        _failure(prepare) if rank == 0 else None, f"preparing checkpoint folder {tmp}", engine.control_group, fix
    )

    def write() -> None:
        dcp.save(_state(engine), checkpoint_id=str(tmp), no_dist=world == 1)
        torch.save(rng_state(), tmp / f"rng-rank{rank:05d}.pt")
        if rank == 0:
            trainer = {"lr_scheduler": engine.lr_scheduler.state_dict(), "global_step": engine.global_step}
            torch.save({**trainer, "extra": extra or {}}, tmp / "trainer.pt")

    try:
        agree(_failure(write), f"writing checkpoint {tmp}", engine.control_group, fix)
    except CheckpointError:
        if rank == 0:  # a full disk must not keep the partial folder too
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def publish() -> None:
        # meta.json last: its presence marks a complete checkpoint, then the rename publishes it
        write_meta(tmp, engine_meta(engine, step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_latest(root, final.name)

    agree(_failure(publish) if rank == 0 else None, f"publishing checkpoint {final}", engine.control_group, fix)
    return final


def _layout_text(m: CheckpointMeta) -> str:
    return f"dp={m.dp} x ring={m.ring} x ulysses={m.ulysses}"


def _check(engine: TrainState, path: Path, meta: CheckpointMeta, stored: dict) -> str | None:
    """Why ``path`` cannot load into ``engine`` (None: it can), from metadata only: nothing changes."""
    mine = engine_meta(engine, meta.step)
    for name in ("model_class", "model_fingerprint", "lora"):
        theirs, ours = getattr(meta, name), getattr(mine, name)
        if theirs != ours:
            return (
                f"checkpoint {path} has {name}={theirs!r} but this run has {name}={ours!r}; fix: resume with "
                "the same model and LoRA settings it was written with (any layout works)"
            )
    if meta.format >= 2 and meta.lora_fingerprint != mine.lora_fingerprint:
        return (
            f"checkpoint {path} was written with other LoRA settings (rank, alpha, target modules or init: "
            f"fingerprint {meta.lora_fingerprint} vs {mine.lora_fingerprint} here, LoRA {engine.lora}); fix: "
            "resume with the LoRA settings it was written with"
        )
    if not (path / "trainer.pt").exists():
        return f"checkpoint {path} has no trainer.pt (LR schedule, step); it is incomplete: fix: load an earlier step"
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for key, value in get_model_state_dict(engine.model).items():
        entry = stored.get(f"model.{key}")
        if entry is None:
            return f"checkpoint {path} lacks model tensor {key}; it was written for another model or is incomplete"
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(value.shape):
            return (
                f"checkpoint {path} stores {key} with shape {tuple(entry.size)}, this model has "
                f"{tuple(value.shape)}; fix: resume with the model (and LoRA rank) it was written with"
            )
    return None


def _adamw_placeholders(optimizer: torch.optim.Optimizer) -> defaultdict:
    """Zero AdamW state for every parameter, to load into. Made here rather than by torch's state-dict helper,
    which makes it by a zero-gradient step: that step's gradients and temporaries would cost the device two
    more copies of the parameters at the moment memory is tightest."""
    state: defaultdict = defaultdict(dict)  # what torch.optim.Optimizer starts from
    for group in optimizer.param_groups:
        for p in group["params"]:
            state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),  # AdamW's own host scalar
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state[p]["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _host_backup(model_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's parameter shards, copied to host memory: what a failed in-place load puts back (the device
    never holds a second copy of the model while resuming)."""
    return {k: _local(v).detach().to("cpu", copy=True) for k, v in model_state.items() if torch.is_tensor(v)}


def _restore(model_state: dict[str, Any], backup: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, value in backup.items():
            _local(model_state[key]).copy_(value)


def load_checkpoint(engine: TrainState, path: str | os.PathLike) -> dict[str, Any]:
    """Load ``path`` (a step folder, or a root whose ``latest`` names one) into ``engine``; returns ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    located: list[Path] = []

    def locate() -> None:
        if (path / META).exists():
            located.append(path)
            return
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"no checkpoint at {path} (no {META} and no '{LATEST}')")
        located.append(latest)

    error = _failure(locate)
    agree(
        error.split(": ", 1)[-1] if error else None, f"finding a checkpoint at {path}", engine.control_group
    )
    path = located[0]
    found: dict[str, Any] = {}

    def inspect() -> None:
        found["meta"] = meta = read_meta(path)
        try:
            found["stored"] = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except (Exception, _dcp_exception()) as err:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: {err}") from err
        problem = _check(engine, path, meta, found["stored"])
        if problem:
            raise CheckpointError(problem)
        found["trainer"] = torch.load(path / "trainer.pt", weights_only=False)

    error = _failure(inspect)
    agree(error.split(": ", 1)[-1] if error else None, f"checking checkpoint {path}", engine.control_group)
    meta, stored, trainer = found["meta"], found["stored"], found["trainer"]
    if _layout_text(meta) != _layout_text(engine_meta(engine, meta.step)):
        logger.info("resharding checkpoint %s from %s to this run's layout", path, _layout_text(meta))

    # Loading replaces the optimizer state: from none, so that every parameter gets a placeholder to load into
    # (an engine that already stepped has no state for parameters that never had a gradient). The old state is
    # kept to put back if anything below fails.
    saved_optimizer_state = engine.optimizer.state
    engine.zero_grad()
    engine.optimizer.state = _adamw_placeholders(engine.optimizer)
    state: dict[str, Any] = {}

    def load() -> None:
        # In place: DCP reads into the live parameter shards and into the fresh optimizer placeholders (the old
        # optimizer state stays referenced, untouched). Only the parameters need a way back, and it is kept in
        # host memory: a resume costs the device nothing beyond the engine's own state.
        live = state["live"] = _state(engine)
        # A parameter that never had a gradient has no AdamW state in the checkpoint; its placeholder state is
        # dropped after loading so the optimizer is as saved.
        state["stateless"] = {
            fqn for fqn in live["optimizer"].get("state", {}) if f"optimizer.state.{fqn}.step" not in stored
        }
        state["backup"] = _host_backup(live["model"])
        try:
            dcp.load(
                live,
                checkpoint_id=str(path),
                planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
                no_dist=engine.layout.world == 1,
            )
        except (Exception, _dcp_exception()) as err:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: {err}") from err

    try:
        agree(_failure(load), f"loading checkpoint {path}", engine.control_group)
    except CheckpointError:
        if "backup" in state:
            _restore(state["live"]["model"], state["backup"])
        engine.optimizer.state = saved_optimizer_state
        raise
    del state["backup"]
    loaded = state["live"]
    set_state_dict(
        engine.model,
        engine.optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
        options=StateDictOptions(),
    )
    params = dict(engine.model.named_parameters())
    for fqn in state["stateless"]:
        engine.optimizer.state.pop(params[fqn], None)
    engine.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
    engine.global_step = int(trainer["global_step"])
    if getattr(engine, "ema", None) is not None and not any(k.startswith("ema.") for k in stored):
        engine.ema.reset()  # a checkpoint written without an average: it starts from the loaded parameters
    rng_file = path / f"rng-rank{engine.layout.rank:05d}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    barrier(engine.control_group)
    return trainer.get("extra", {})
