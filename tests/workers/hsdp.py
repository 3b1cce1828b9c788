"""HSDP on real gloo ranks: checkpoints written under one sharding layout and loaded under another (both ways), the
step an HSDP engine takes against the same step under plain FSDP, and the ledger's count of HSDP's gradient
reductions. Each phase dumps full states to files in ``root``; the parent compares them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tests.workers.faults import _full, _full_state

# phase: (world, ulysses, dp_replicate); a and d plain FSDP at dp 2 x SP 2, b HSDP 2 x (shard 2 = SP 2), c dp 2 x SP 1
PHASES = {"a": (4, 2, 1), "b": (4, 2, 2), "c": (2, 1, 1), "d": (4, 2, 1)}
BATCH = 4


def _grads(engine) -> dict:
    return {
        f"grad:{n}": _full(p.grad) if p.grad is not None else torch.zeros_like(_full(p))
        for n, p in engine.model.named_parameters()
        if p.requires_grad
    }


def expected_grad_reduce(engine) -> tuple[int, int, int]:
    """``(calls, bytes, all-reduce bytes)`` the ledger should count as ``grad_reduce`` for one backward, from the
    FSDP groups' parameters that received a gradient: per group one reduce-scatter of the padded gradients over
    the shard group (bus bytes ``S_in (P-1)/P``) and, under HSDP, one all-reduce of the reduced shard S across the
    R replicas (``2 S (R-1)/R``), all in fp32. Call between backward and the optimizer step."""
    layout = engine.layout
    shard, replicate = layout.world // layout.replicate, layout.replicate
    calls = nbytes = all_reduce = 0
    for module in engine.model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        if group is None:
            continue
        reduced = [fp for fp in group.fsdp_params if fp.sharded_param.grad is not None]
        if not reduced:
            continue
        # FSDP pads dim 0 to a multiple of the shard group: the reduced shard holds ceil(d0 / P) rows of each
        shard_bytes = 0
        for fp in reduced:
            shape = fp.sharded_param.shape  # the DTensor's global shape
            rest = int(torch.Size(shape[1:]).numel())
            shard_bytes += -(-shape[0] // shard) * rest * 4
        calls += 1
        nbytes += shard_bytes * shard * (shard - 1) // shard
        if replicate > 1:
            calls += 1
            ar = 2 * shard_bytes * (replicate - 1) // replicate
            nbytes += ar
            all_reduce += ar
    return calls, nbytes, all_reduce


def resume_across_layouts(rank: int, world: int, phase: str, root: str) -> dict:
    """``a`` (plain FSDP, dp 2 x SP 2) trains 2 steps, saves, then takes step 3 (the reference); ``b`` (HSDP 2 x SP
    2) loads that checkpoint, takes step 3 under the communication ledger and saves; ``c`` (dp 2 x SP 1) and ``d``
    (dp 2 x SP 2) load b's checkpoint. Every phase splits the same 4 samples over its dp = 2 ranks."""
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.parallel.ledger import CommLedger
    from sp_diffusers.tiny import tiny_inputs, tiny_model
    from tests._parity import PARITY_EPS, PARITY_LR

    dlogging.set_verbosity(logging.ERROR)
    root_dir = Path(root)
    _, ulysses, replicate = PHASES[phase]
    optim = sp_diffusers.OptimSettings(lr=PARITY_LR, eps=PARITY_EPS, max_grad_norm=0.0)
    engine = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1),
        ulysses_sequence_parallel_size=ulysses,
        dp_replicate=replicate,
        optim=optim,
    )
    full = tiny_inputs(
        "qwenimage", tiny_model("qwenimage", num_layers=1), batch=BATCH, text_len=8, ragged_text=False
    )
    dp, dp_rank = engine.layout.dp, engine.dp_rank
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    batch = {
        k: (v[rows].to(engine.device) if torch.is_tensor(v) else v[rows] if isinstance(v, list) else v)
        for k, v in full.items()
    }

    def loss_fn(eng, b):
        return eng.forward(**b).square().mean(), {}

    def dump(name: str, state: dict) -> None:
        if rank == 0:
            torch.save(state, root_dir / f"{name}.pt")

    def step3() -> dict:
        """Step 3 with its gradients and the state before it, as full tensors."""
        before = _full_state(engine)
        engine.zero_grad()
        engine.forward_backward(batch, loss_fn)
        grads = _grads(engine)
        engine.optimizer_step()
        return {**_full_state(engine), **grads, **{f"before:{k}": v for k, v in before.items()}}

    plain, hsdp = root_dir / "plain", root_dir / "hsdp"
    out: dict = {"phase": phase, "mesh": str(engine.shard_mesh)}
    if phase == "a":
        for _ in range(2):
            engine.train_step(batch, loss_fn)
        engine.save_checkpoint(plain, step=2)
        dump("a_saved", _full_state(engine))
        dump("a_step3", step3())
    elif phase == "b":
        engine.load_checkpoint(plain / "step-00000002")
        dump("b_loaded", _full_state(engine))
        before = _full_state(engine)
        ledger = CommLedger()
        engine.zero_grad()
        with ledger.recording():
            engine.forward_backward(batch, loss_fn)
        out["ledger"] = {f"{p}/{k}": v for (p, k), v in ledger.take().items() if k == "grad_reduce"}
        out["expected"] = expected_grad_reduce(engine)
        grads = _grads(engine)
        engine.optimizer_step()
        dump("b_step3", {**_full_state(engine), **grads, **{f"before:{k}": v for k, v in before.items()}})
        engine.save_checkpoint(hsdp, step=3)
    else:
        engine.load_checkpoint(hsdp / "step-00000003")
        dump(f"{phase}_loaded", _full_state(engine))
    out["global_step"] = engine.global_step
    return out
