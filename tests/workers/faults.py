"""Fault handling on real ranks: a non-finite loss on one rank skips the step on every rank; SP peers with
different parameters are refused."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch


def non_finite_and_divergent_parameters(rank: int, world: int) -> dict:
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.engine import SPDivergenceError
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    dlogging.set_verbosity(logging.ERROR)
    out = {}
    engine = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1), ulysses_sequence_parallel_size=world
    )
    inputs = tiny_inputs("qwenimage", tiny_model("qwenimage", num_layers=1), batch=1, text_len=8)
    inputs = {k: (v.to(engine.device) if torch.is_tensor(v) else v) for k, v in inputs.items()}
    before = {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}

    def loss_fn(eng, batch):
        loss = eng.forward(**inputs).square().mean()
        if rank == world - 1:  # only the last rank sees a NaN (e.g. an overflow in its sequence shard)
            loss = loss * float("nan")
        return loss, {}

    metrics = engine.train_step({}, loss_fn)
    out["skipped"] = metrics["step_skipped"]
    out["grad_norm_finite"] = bool(torch.isfinite(torch.tensor(metrics["grad_norm"])))
    out["params_unchanged"] = all(
        torch.equal(before[n], p.full_tensor()) for n, p in engine.model.named_parameters()
    )
    out["global_step"] = engine.global_step
    metrics = engine.train_step({}, lambda eng, b: (eng.forward(**inputs).square().mean(), {}))
    out["next_step_taken"] = metrics["step_skipped"] == 0.0 and engine.global_step == 1

    replicas = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1),
        ulysses_sequence_parallel_size=world,
        use_fsdp=False,
        debug_checks=True,
    )
    with torch.no_grad():
        next(replicas.model.parameters()).add_(float(rank) * 1e-3)  # a replica that drifted
    try:
        replicas.train_step({}, lambda eng, b: (eng.forward(**inputs).square().mean(), {}))
        out["divergent_parameters"] = None
    except SPDivergenceError as err:
        out["divergent_parameters"] = str(err)
    return out


def step_agreement(rank: int, world: int) -> dict:
    """dp 2 x sp 2 on 4 ranks. (1) data-parallel ranks with 1 and 3 samples: the gradient is the mean over the
    4 samples; (2) a loss_fn that raises on one rank only, after the forward: every rank raises promptly;
    (3) loss_fn results that are not a scalar loss with grad: the error names loss_fn."""
    import time

    import torch.distributed as dist
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.engine import StepError
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    dlogging.set_verbosity(logging.ERROR)
    out: dict = {}
    model = tiny_model("qwenimage", num_layers=1)
    full = tiny_inputs("qwenimage", model, batch=4, text_len=8, ragged_text=False)
    reference = tiny_model("qwenimage", num_layers=1)
    per_sample = reference(**full, return_dict=False)[0].square().mean(dim=(1, 2))  # [4]
    per_sample.mean().backward()  # one process: the mean over the 4 samples
    # parameters outside the loss's graph (the last block's text path) have no gradient: zeros under FSDP
    ref = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in reference.named_parameters()
    }

    engine = sp_diffusers.FSDPEngine(model, ulysses_sequence_parallel_size=2)
    rows = slice(0, 1) if engine.dp_rank == 0 else slice(1, 4)

    def take(v):
        return v[rows] if torch.is_tensor(v) or isinstance(v, list) else v

    batch = {k: take(v) for k, v in full.items()}

    def loss_fn(eng, b):
        return eng.forward(**b).square().mean(), {}

    engine.zero_grad()
    engine.forward_backward(batch, loss_fn, num_samples=len(batch["img_shapes"]))
    err = 0.0
    for n, p in engine.model.named_parameters():
        g = p.grad.full_tensor() if p.grad is not None else torch.zeros_like(ref[n])
        err = max(err, ((g - ref[n]).abs() - 1e-4 * ref[n].abs()).max().item())
    out["unequal_dp_grad_excess"] = err
    engine.zero_grad()

    def fails_on_rank_1(eng, b):
        loss = eng.forward(**b).square().mean()
        if rank == 1:
            raise RuntimeError("a bug in this rank's reward")
        return loss, {}

    start = time.perf_counter()
    try:
        engine.forward_backward(batch, fails_on_rank_1)
        out["one_rank_fails"] = None
    except (StepError, RuntimeError) as e:
        out["one_rank_fails"] = f"{type(e).__name__}: {e}"
    out["one_rank_fails_seconds"] = time.perf_counter() - start
    engine.zero_grad()
    dist.barrier()

    bad = {
        "non_scalar": lambda eng, b: (eng.forward(**b).square(), {}),
        "python_float": lambda eng, b: (float(eng.forward(**b).square().mean()), {}),
        "no_grad": lambda eng, b: (eng.forward(**b).square().mean().detach(), {}),
        "not_a_pair": lambda eng, b: eng.forward(**b).square().mean(),
    }
    for name, fn in bad.items():
        try:
            engine.forward_backward(batch, fn)
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = str(e)
        dist.barrier()

    # (4) an output folder another live run holds: every rank raises the same RunDirInUse
    from sp_diffusers.flowgrpo.io.run_lock import RunDirInUse, _try_lock, lock_run_dir

    folder = [tempfile.mkdtemp(prefix="sp-lock-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    held = _try_lock(Path(folder[0]))[0] if rank == 0 else None  # "the other run"
    try:
        lock_run_dir(folder[0], rank)
        out["run_dir_in_use"] = None
    except RunDirInUse as e:
        out["run_dir_in_use"] = str(e)
    if held is not None:
        held.close()
    dist.barrier()
    free = lock_run_dir(folder[0], rank)  # released: the next run gets it
    out["run_dir_free_again"] = True
    if free is not None:
        free.close()

    # (5) saves that fail on one rank: every rank raises the same CheckpointError, nothing half-written stays
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from sp_diffusers.engine.checkpoint import CheckpointError, find_latest

    root = Path(folder[0]) / "ckpts"
    engine.save_checkpoint(root, step=1)
    blocker = Path(folder[0]) / "a-file"  # rank 0 cannot create a folder under a file (read-only stands in)
    if rank == 0:
        blocker.write_text("")
    dist.barrier()
    for name, run in (
        ("save_root_unwritable", lambda: engine.save_checkpoint(blocker / "ckpts", step=2)),
        (
            "save_disk_full_on_rank_1",
            lambda: _save_with_full_disk(engine, root, rank, FileSystemWriter, errno),
        ),
    ):
        try:
            run()
            out[name] = None
        except CheckpointError as e:
            out[name] = str(e)
        dist.barrier()
    out["partial_folders_left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp"))
    out["latest_after_failures"] = find_latest(root).name
    return out


def _save_with_full_disk(engine, root, rank: int, writer_class, errno_module) -> None:
    from unittest import mock

    real = writer_class.write_data

    def full(self, plan, planner):
        if rank == 1:
            raise OSError(errno_module.ENOSPC, "No space left on device")
        return real(self, plan, planner)

    with mock.patch.object(writer_class, "write_data", full):
        engine.save_checkpoint(root, step=2)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _full_state(engine) -> dict:
    """Every parameter and its AdamW state as full tensors, by name (collective: every rank calls it)."""
    out = {}
    for name, p in engine.model.named_parameters():
        if not p.requires_grad:
            continue
        out[f"param:{name}"] = _full(p)
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[f"{key}:{name}"] = _full(value) if torch.is_tensor(value) else torch.tensor(value)
    return out


def resume_on_other_layouts(rank: int, world: int, phase: str, root: str) -> dict:
    """One phase of a run preempted twice: ``a`` trains 2 steps at SP 2 (2 ranks) and saves; ``b`` resumes that
    checkpoint at dp 2 x SP 2 (4 ranks), takes step 3 on its half of the batch and saves; ``c`` (1 process)
    loads both checkpoints and takes step 3 from the first one itself: the reference. Full states go to files
    in ``root`` for the test to compare."""
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model
    from tests._parity import PARITY_EPS, PARITY_LR

    dlogging.set_verbosity(logging.ERROR)
    root_dir = Path(root)
    sp = {"a": 2, "b": 2, "c": 1}[phase]
    optim = sp_diffusers.OptimSettings(lr=PARITY_LR, eps=PARITY_EPS, max_grad_norm=0.0)
    engine = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1), ulysses_sequence_parallel_size=sp, optim=optim
    )
    full = tiny_inputs(
        "qwenimage", tiny_model("qwenimage", num_layers=1), batch=4, text_len=8, ragged_text=False
    )
    dp, dp_rank = engine.layout.dp, engine.dp_rank
    rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    batch = {
        k: (v[rows].to(engine.device) if torch.is_tensor(v) else v[rows] if isinstance(v, list) else v)
        for k, v in full.items()
    }

    def loss_fn(eng, b):
        return eng.forward(**b).square().mean(), {}

    def dump(name: str, state: dict) -> None:
        if rank == 0:
            torch.save(state, root_dir / f"{name}.pt")

    ckpts = root_dir / "checkpoints"
    if phase == "a":
        for _ in range(2):
            engine.train_step(batch, loss_fn)
        engine.save_checkpoint(ckpts, step=2)
        dump("a_saved", _full_state(engine))
    elif phase == "b":
        engine.load_checkpoint(ckpts / "step-00000002")
        dump("b_loaded", _full_state(engine))
        engine.train_step(batch, loss_fn)
        engine.save_checkpoint(ckpts, step=3)
        dump("b_step3", _full_state(engine))
    else:
        engine.load_checkpoint(ckpts / "step-00000002")
        state2 = _full_state(engine)
        engine.zero_grad()
        engine.forward_backward(batch, loss_fn)
        grads = {
            f"grad:{n}": _full(p.grad) if p.grad is not None else torch.zeros_like(_full(p))
            for n, p in engine.model.named_parameters()
            if p.requires_grad
        }
        engine.optimizer_step()
        dump("c_step3", {**_full_state(engine), **grads, **{f"before:{k}": v for k, v in state2.items()}})
        engine.load_checkpoint(ckpts / "step-00000003")
        dump("c_loaded3", _full_state(engine))
    return {"phase": phase, "world": world, "global_step": engine.global_step}


def compiled_under_sp(rank: int, world: int) -> dict:
    """``torch.compile(backend="aot_eager")`` of a Qwen-Image at SP 2 (ragged 7-token text: uneven shards), with
    ``ulysses_sdpa`` and with ``native``: forward and gradients against the same model run eagerly, both after
    a forward under ``torch.inference_mode()``."""
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    dlogging.set_verbosity(logging.ERROR)
    sp_diffusers.install()
    out = {}
    for backend in ("ulysses_sdpa", "native"):
        model = tiny_model("qwenimage", num_layers=1)
        inputs = tiny_inputs("qwenimage", model, batch=2, text_len=7)
        model.set_attention_backend(backend)
        model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=world))
        with torch.inference_mode():  # once poisoned the cached CPU send buffer for every later forward
            model(**inputs, return_dict=False)
        runs = []
        for compiled in (False, True):
            model.zero_grad(set_to_none=True)
            fn = torch.compile(model, backend="aot_eager", fullgraph=False) if compiled else model
            o = fn(**inputs, return_dict=False)[0]
            o.square().mean().backward()
            # the last block's text path is outside the output's graph: eager leaves None, compiled may give 0
            grads = {
                n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in model.named_parameters()
            }
            runs.append((o.detach().clone(), grads))
        (o_e, g_e), (o_c, g_c) = runs
        out[backend] = {
            "out_diff": (o_c - o_e).abs().max().item(),
            "grad_diff": max((g_c[n] - g_e[n]).abs().max().item() for n in g_e),
            "nonzero_grads": sum(bool(g.abs().max() > 0) for g in g_e.values()),
        }
        model.reset_attention_backend()
        torch._dynamo.reset()
    return out
