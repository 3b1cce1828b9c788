"""The GPU-path canary: every family with a plan, forward and backward at world size 8, in one CPU process.

    python -m tests.workers.canary        # prints one JSON object: per case, what ran (tests/test_canary.py)

torch's fake process group stands in for 8 GPUs (its collectives return at once and move no data) and the
``meta`` device stands in for CUDA: sp_diffusers' kernel layer runs the fused CUDA kernels' aten ops on meta
(flash / efficient, forward and backward), a tensor born on the CPU meeting a meta one raises, and so does
any host read of a tensor (``.item()``, ``.tolist()``, ``bool()``). (Fake CUDA tensors exist on a CPU build,
but indexing one needs the CUDA runtime, so whole models cannot run on them.) The group moves no data, so
the per-forward agreement is switched off: ``set_rank_agreement(model, "trusted")``.

Layouts: Ulysses 8 in bf16 (flash where there is no mask) and Ulysses 4 x Ring 2 in fp32 (efficient). The
aten attention ops dispatched inside sp_diffusers' attention (its backend calls and their backward) are
recorded per case.

HunyuanVideo-1.5's own forward reorders its context with boolean indexing (data-dependent shapes), which no
meta or fake tensor can run: it runs on CPU tensors with the fake group, and the case records the host reads
made by sp_diffusers' code (there must be none).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .model_cases import MODELS, build, outputs, sp_inputs

CPU_ONLY = ("hunyuanvideo15",)  # data-dependent shapes in diffusers' own forward (see the module docstring)
# every split must divide 8: HunyuanVideo-1.5's context is T + T/2 + 3 tokens (24 at T = 14)
INPUTS = {"hunyuanvideo15": {"text_len": 14}}
LAYOUTS = ((8, 1, torch.bfloat16), (4, 2, torch.float32))


class _AttentionOps(TorchDispatchMode):
    """The aten ops dispatched while sp_diffusers' attention runs (``depth > 0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.ops: set[str] = set()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth:
            name = str(func)
            if "attention" in name or "softmax" in name or name.startswith(("aten.bmm", "aten.baddbmm")):
                self.ops.add(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _watching(ops: _AttentionOps):
    """Mark sp_diffusers' attention: the registered backend and the kernels' backward (ring and one-shot)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from sp_diffusers.parallel import kernels, ring
    from sp_diffusers.patching.backend_registration import BACKEND_NAME

    member = AttentionBackendName(BACKEND_NAME)
    backend = _AttentionBackendRegistry._backends[member]
    originals = {(kernels, "attention_backward"): kernels.attention_backward}
    originals[(ring, "attention_backward")] = ring.attention_backward

    def inside(fn, count: bool = False):
        def wrapped(*args, **kwargs):
            ops.depth += 1
            ops.calls += count
            try:
                return fn(*args, **kwargs)
            finally:
                ops.depth -= 1

        return wrapped

    _AttentionBackendRegistry._backends[member] = inside(backend, count=True)
    for (owner, name), fn in originals.items():
        setattr(owner, name, inside(fn))
    try:
        with ops:
            yield
    finally:
        _AttentionBackendRegistry._backends[member] = backend
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


@contextlib.contextmanager
def _meta_autocast():
    """``torch.autocast(device_type="meta", enabled=False)`` (Helios' RoPE) is refused by torch; on meta there
    is nothing to cast, so it becomes the CPU's disabled autocast."""
    original = torch.autocast

    class autocast(original):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = autocast  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast = original  # type: ignore[misc]


def _case(name: str, ulysses: int, ring: int, dtype: torch.dtype, mesh: Any) -> dict:
    import sp_diffusers
    from sp_diffusers.parallel.agreement import set_rank_agreement

    model, inputs = build(name, "even", seed=0)
    if name in INPUTS:
        from sp_diffusers.tiny import tiny_inputs

        kwargs = {**MODELS[name].even, **INPUTS[name]}
        inputs = tiny_inputs(MODELS[name].kind, model, batch=2, seed=1, **kwargs)
    inputs = sp_inputs(name, "even", inputs, ulysses * ring)
    on_meta = name not in CPU_ONLY
    device = "meta" if on_meta else "cpu"

    def move(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    model = model.to(device=device, dtype=dtype)
    inputs = tree_map(move, inputs)
    model.set_attention_backend("ulysses_sdpa")
    model.enable_parallelism(
        config=sp_diffusers.context_parallel_config(ulysses_degree=ulysses, ring_degree=ring, mesh=mesh)
    )
    set_rank_agreement(model, "trusted")  # the fake group moves no data: nothing to agree with
    ops = _AttentionOps()
    result: dict[str, Any] = {"device": device}
    if on_meta:
        with _watching(ops), _meta_autocast():
            outs = outputs(model(**inputs, return_dict=False))
            sum(o.float().sum() for o in outs).backward()
    else:
        from .hot_path import Recorder, recording

        rec = Recorder()
        with _watching(ops), recording(rec):
            rec.tag.update({"pass": "canary", "phase": "forward"})
            outs = outputs(model(**inputs, return_dict=False))
            rec.tag["phase"] = "backward"
            sum(o.float().sum() for o in outs).backward()
        result["syncs_ours"] = sorted({e["op"] for e in rec.events if e["kind"] == "sync" and e["ours"]})
    with_grad = sum(p.grad is not None for p in model.parameters())
    result.update(
        {
            "ops": sorted(ops.ops),
            "attention_calls": ops.calls,
            "outputs": [list(o.shape) for o in outs],
            "params_with_grad": with_grad,
            "params": len(list(model.parameters())),
        }
    )
    return result


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # the fake group for every device the run touches (meta included: the ring's point-to-point batches)
    dist.init_process_group("cpu:fake,meta:fake,cuda:fake", store=FakeStore(), rank=0, world_size=8)
    from diffusers.utils import logging as dlogging

    import sp_diffusers

    dlogging.set_verbosity(logging.ERROR)
    sp_diffusers.install()
    results: dict[str, Any] = {}
    for ulysses, ring, dtype in LAYOUTS:
        mesh = sp_diffusers.build_device_mesh(ulysses_degree=ulysses, ring_degree=ring)
        for name in MODELS:
            case = f"{name}/u{ulysses}r{ring}/{str(dtype).removeprefix('torch.')}"
            try:
                results[case] = _case(name, ulysses, ring, dtype, mesh)
            except Exception as err:
                frames = traceback.extract_tb(err.__traceback__)[-4:]
                where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames]
                results[case] = {"error": f"{type(err).__name__}: {err}", "where": where}
    results.update(_negatives())
    results["ring_memory"] = _ring_memory()
    results["gradient_contract"] = _gradient_contract()
    dist.destroy_process_group()
    print(json.dumps(results))


def _negatives() -> dict[str, Any]:
    """The canary must catch what it exists for: one injected regression each (Flux, Ulysses 8)."""
    from unittest import mock

    import sp_diffusers
    from sp_diffusers.parallel import attention, kernels

    mesh = sp_diffusers.build_device_mesh(ulysses_degree=8)
    real_local = attention.local_sdpa_attention

    def host_read(query, *args, **kwargs):
        int(query.shape[1] * query.flatten()[0].item())  # a host sync on the hot path
        return real_local(query, *args, **kwargs)

    def cpu_born(query, *args, **kwargs):
        return real_local(query, *args, **kwargs) + torch.zeros(query.shape[-1])  # a tensor born on the CPU

    injected = {
        "host_read": mock.patch.object(attention, "local_sdpa_attention", host_read),
        "cpu_born": mock.patch.object(attention, "local_sdpa_attention", cpu_born),
        "math_kernel": mock.patch.object(kernels, "kernel_for", lambda q, has_mask: "math"),
    }
    out = {}
    for name, patch in injected.items():
        try:
            with patch:
                out[f"negative:{name}"] = _case("flux", 8, 1, torch.float32, mesh)
        except Exception as err:
            out[f"negative:{name}"] = {"error": f"{type(err).__name__}: {err}"}
    return out


def _ring_memory(heads: int = 2, head_dim: int = 16) -> dict[str, Any]:
    """Ring attention (R = 8, this rank's share) on CPU tensors, forward and backward, under torch's memory
    tracker: its peak and the largest tensor allocated, at S = 16k with the CPU flash kernel and - the control,
    at S = 4k to keep it cheap - with the plain math kernel, which builds a ``[B, H, S/R, S/R]`` score matrix
    per chunk."""
    from unittest import mock

    from torch.distributed._tools.mem_tracker import MemTracker

    from sp_diffusers.parallel import kernels
    from sp_diffusers.parallel.ring import ring_attention

    group = dist.group.WORLD
    largest = [0]

    class _Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    largest[0] = max(largest[0], t.untyped_storage().nbytes())
            return out

    def measure(seq: int) -> dict[str, int]:
        largest[0] = 0
        s_l = seq // dist.get_world_size(group)
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, s_l, head_dim, generator=g) for _ in range(4))
        ins = [t.requires_grad_(True) for t in (q, k, v)]
        tracker = MemTracker()
        tracker.track_external(*ins)
        with tracker, _Largest():
            ring_attention(*ins, group).backward(dout)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return {
            "peak": peak,
            "largest": largest[0],
            "q_bytes": q.numel() * q.element_size(),
            "score_bytes": heads * s_l * s_l * 4,  # one chunk's fp32 scores: this rank's queries x one chunk
        }

    fused = measure(16384)
    with mock.patch.object(kernels, "kernel_for", lambda t, has_mask: "math"):
        math = measure(4096)
    return {"fused": fused, "math": math}


def _gradient_contract() -> dict[str, Any]:
    """FSDPEngine's gradient contract on NCCL's reduce ops. The fake group is not gloo, so the engine takes the
    NCCL path (no forced SUM): FSDP2 folds the divide factor (dp) into the reduce-scatter itself - ``AVG`` when
    it equals the group size (sp = 1), else ``PREMUL_SUM(1/dp)`` - and divides nothing before or after; under
    HSDP the reduce-scatter runs within a replica group and an all-reduce with SUM across the groups follows.
    Recorded per layout: every reduce-scatter's and all-reduce's op, factor, dtype and group size, and every
    extra division."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    calls: list[dict[str, Any]] = []
    all_reduces: list[dict[str, Any]] = []
    divisions: list[float] = []
    saved = {
        name: getattr(dist, name)
        for name in ("reduce_scatter_single", "reduce_scatter_tensor")
        if hasattr(dist, name)
    }

    def described(tensor, op, group) -> dict[str, Any]:
        return {
            "op": str(getattr(op, "op", op)).rsplit(".", 1)[-1],
            "factor": getattr(op, "factor", None),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "group": dist.get_world_size(group),
        }

    def recording(fn):
        def wrapped(output, input, *args, op=None, group=None, **kwargs):
            calls.append(described(input, op, group))
            return fn(output, input, *args, op=op, group=group, **kwargs)

        return wrapped

    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, **kwargs):
        all_reduces.append(described(tensor, op, group))
        return real_all_reduce(tensor, op=op, group=group, **kwargs)

    real_div = collectives._div_if_needed

    def div(tensor, factor):
        if factor is not None and factor != 1:
            divisions.append(float(factor))
        return real_div(tensor, factor)

    out: dict[str, Any] = {}
    for name, fn in saved.items():
        setattr(dist, name, recording(fn))
    collectives._div_if_needed = div
    dist.all_reduce = all_reduce  # FSDP2 calls it as dist.all_reduce (HSDP's cross-replica sum)
    try:
        for sp, replicate in ((4, 1), (1, 1), (4, 2)):
            calls.clear()
            all_reduces.clear()
            divisions.clear()
            model = tiny_model("flux", seed=0)
            engine = sp_diffusers.FSDPEngine(
                model,
                ulysses_sequence_parallel_size=sp,
                dp_replicate=replicate,
                device="cpu",
                mixed_precision="bf16",
            )
            inputs = tiny_inputs("flux", model, batch=2, seed=1, image_hw=(4, 4), text_len=8)
            engine.model(**inputs, return_dict=False)[0].float().sum().backward()
            name = f"dp{engine.dp_size}_sp{sp}" + (f"_replicate{replicate}" if replicate > 1 else "")
            out[name] = {"calls": list(calls), "all_reduces": list(all_reduces), "divisions": list(divisions)}
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        collectives._div_if_needed = real_div
        dist.all_reduce = real_all_reduce
    return out


if __name__ == "__main__":
    sys.exit(main())
