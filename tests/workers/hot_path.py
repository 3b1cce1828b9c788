"""The hot-path contract, counted: host syncs and collectives per attention call, per forward and in backward,
for every tiny model of ``model_cases`` under Ulysses and Ulysses x Ring (one 4-rank process group).

Each case (model, length, layout) runs three forward+backward passes of one model:
  1. ``learn``   the first forward with these input shapes (an uneven one learns its calls' layouts here);
  2. ``steady``  the same inputs again with activation checkpointing on (blocks recomputed in backward);
  3. ``trusted`` the same again with ``set_rank_agreement(model, "trusted")`` (the engine's setting; Ulysses
     layout only).

Counted events (each tagged with the pass, forward/backward and the attention call it happened in, if any):
  collective  a ``torch.distributed`` collective (point-to-point batches are ``p2p``);
  meta        an exchange of metadata: the per-forward agreement, a per-call handshake, a gathered length;
  sync        a host read of tensor data (``.item()``, ``bool()``, ``.tolist()``, ``nonzero`` ...), attributed
              to sp_diffusers (``ours``) or to the code around it (diffusers' model, this worker) by the first
              frame on the Python stack outside torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .model_cases import MODELS, build, outputs, sp_inputs

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = (os.path.join(_REPO, "sp_diffusers") + os.sep, os.path.join(_REPO, "patches") + os.sep)
_TORCH = os.sep + "torch" + os.sep
_SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.equal.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
}
_COLLECTIVES = (
    "all_to_all_single",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "barrier",
)


def _ours() -> bool:
    """Whether the innermost frame outside torch (and this file) belongs to sp_diffusers."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _TORCH not in name and name != __file__:
            return name.startswith(_OURS)
        frame = frame.f_back
    return False


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []
        self.tag: dict[str, Any] = {"pass": None, "phase": None, "call": None}
        self.meta_depth = 0

    def add(self, kind: str, **extra: Any) -> None:
        if self.tag["pass"] is not None:
            self.events.append({**self.tag, "kind": kind, **extra})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        bool_index = name == "aten.index.Tensor" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        if name in _SYNC_OPS or bool_index:
            self.add("sync", op=name, ours=_ours())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording(rec: Recorder):
    """Count collectives, metadata exchanges and host syncs while the block runs."""
    from sp_diffusers.parallel import agreement, attention, cp_groups
    from sp_diffusers.patching import scope_hooks
    from sp_diffusers.patching.backend_registration import BACKEND_NAME

    saved: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, name: str, new: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def collective(fn, name):
        def wrapped(*args, **kwargs):
            if rec.meta_depth == 0:
                rec.add("p2p" if name == "batch_isend_irecv" else "collective", op=name)
            return fn(*args, **kwargs)

        return wrapped

    for name in (*_COLLECTIVES, "batch_isend_irecv"):
        if hasattr(dist, name):
            swap(dist, name, collective(getattr(dist, name), name))

    def meta(fn):
        def wrapped(*args, **kwargs):
            rec.add("meta")
            rec.meta_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                rec.meta_depth -= 1

        return wrapped

    for module in (agreement, cp_groups):
        swap(module, "gather_ints", meta(module.gather_ints))

    def host_read(fn, name):
        def wrapped(self, *args, **kwargs):
            rec.add("sync", op=f"Tensor.{name}", ours=_ours())
            return fn(self, *args, **kwargs)

        return wrapped

    def closing(scope):
        rec.add("scope", even=scope.even)
        return agreement.pop(scope)

    swap(scope_hooks, "pop", closing)

    for name in ("tolist", "cpu", "numpy"):
        swap(torch.Tensor, name, host_read(getattr(torch.Tensor, name), name))

    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    member = AttentionBackendName(BACKEND_NAME)

    backend = _AttentionBackendRegistry._backends[member]
    calls = [0]

    def counted_backend(*args, **kwargs):
        outer = rec.tag["call"]
        rec.tag["call"] = calls[0]
        calls[0] += 1
        try:
            return backend(*args, **kwargs)
        finally:
            rec.tag["call"] = outer

    _AttentionBackendRegistry._backends[member] = counted_backend
    try:
        with rec:
            yield
    finally:
        _AttentionBackendRegistry._backends[member] = backend
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
    del attention  # imported so that the backend module is loaded before counting starts


def _loss(outs: list[torch.Tensor], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=g)).mean() for o in outs)


def _summary(events: list[dict]) -> dict:
    """Per pass: per attention call (forward and recomputed) and outside calls, forward and backward."""
    out: dict[str, Any] = {}
    for name in ("learn", "steady", "trusted"):
        mine = [e for e in events if e["pass"] == name]
        if not mine:
            continue
        per_call: dict[tuple, dict] = {}
        outside = {
            ph: {"collective": 0, "p2p": 0, "meta": 0, "sync_ours": 0, "sync_other": 0}
            for ph in ("forward", "backward")
        }
        for e in mine:
            if e["kind"] == "scope":
                continue
            key = (
                "sync_ours"
                if e["kind"] == "sync" and e["ours"]
                else "sync_other"
                if e["kind"] == "sync"
                else e["kind"]
            )
            if e["call"] is None:
                outside[e["phase"]][key] += 1
            else:
                c = per_call.setdefault(
                    (e["phase"], e["call"]),
                    {"collective": 0, "p2p": 0, "meta": 0, "sync_ours": 0, "sync_other": 0},
                )
                c[key] += 1
        out[name] = {
            "calls": {
                ph: [c for (p, _), c in sorted(per_call.items()) if p == ph] for ph in ("forward", "backward")
            },
            "outside": outside,
            "sync_ops_ours": sorted({e["op"] for e in mine if e["kind"] == "sync" and e["ours"]}),
            "even": [e["even"] for e in mine if e["kind"] == "scope"],
        }
    return out


def hot_path_counts(rank: int, world: int, names: list[str], layouts: list[tuple[int, int]]) -> dict:
    import logging

    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.parallel.agreement import set_rank_agreement

    dlogging.set_verbosity(logging.ERROR)
    sp_diffusers.install()
    results: dict[str, Any] = {}
    for ulysses, ring in layouts:
        mesh = sp_diffusers.build_device_mesh(ulysses_degree=ulysses, ring_degree=ring)
        for name in names:
            for length in ("even", "uneven"):
                case = f"{name}/{length}/u{ulysses}r{ring}"
                rec = Recorder()
                try:
                    model, inputs = build(name, length, seed=0)
                    model.set_attention_backend("ulysses_sdpa")
                    model.enable_parallelism(
                        config=sp_diffusers.context_parallel_config(
                            ulysses_degree=ulysses, ring_degree=ring, mesh=mesh
                        )
                    )
                    inputs = sp_inputs(name, length, inputs, ulysses * ring)
                    finite = True
                    with recording(rec):
                        # the trusted pass differs from steady only before the first block: once per family
                        for pass_name in ("learn", "steady", "trusted") if ring == 1 else ("learn", "steady"):
                            if pass_name == "steady" and getattr(
                                model, "_supports_gradient_checkpointing", False
                            ):
                                model.enable_gradient_checkpointing()
                            if pass_name == "trusted":
                                set_rank_agreement(model, "trusted")
                            rec.tag.update({"pass": pass_name, "phase": "forward"})
                            outs = outputs(model(**inputs, return_dict=False))
                            rec.tag["phase"] = "backward"
                            _loss(outs, 0).backward()
                            rec.tag.update({"pass": None, "phase": None})
                            finite = finite and all(bool(torch.isfinite(o).all()) for o in outs)
                    results[case] = {
                        **_summary(rec.events),
                        "finite": finite,
                        "checkpointing": bool(getattr(model, "_supports_gradient_checkpointing", False)),
                    }
                except Exception as err:  # reported per case; the parent asserts
                    results[case] = {"error": f"{type(err).__name__}: {err}"}
                dist.barrier()
    return results


ALL_MODELS = list(MODELS)
