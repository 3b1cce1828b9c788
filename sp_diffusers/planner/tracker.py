"""torch's memory trackers, recording the peak of each *place* of a step, and the collectives it issues.

A place is where in the step the memory is measured: a phase (forward, backward, optimizer) and, inside the
forward and backward, the first or the last transformer block of a block list to run in that phase (ops between
blocks count with the block that runs next; ops after the last block of a phase are the phase's ``end``). The
block shortcut (``plan/extrapolate.py``) needs the peak of every place, not only the step's: each place's
memory grows by a fixed amount per added block, but a different amount per place.

Categories come from ``FSDPMemTracker`` (sharded model) or ``MemTracker`` (one process) and are summed into the
parts the planner reports (:data:`PARTS`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

from .fake_world import DEVICE_QUERY

__all__ = ["PARTS", "Place", "dtensor_shape_inference_untracked", "make_tracker"]

PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")
# torch's categories (FSDPMemTracker's and MemTracker's names) -> the planner's parts. Inputs (the micro-batch)
# and the backward's temporaries count as activations; FSDP's all-gather / reduce-scatter buffers as buffers.
_PART_OF = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Inputs": "activations",
    "Other": "activations",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
}

Place = tuple  # ("start",) | (phase, "end") | (phase, block_list, "first" | "last")

_C10D_FACTOR = {
    # bytes a rank sends, as a multiple of the bytes of the tensor argument named, for a group of P ranks
    "alltoall_base_": lambda p: (p - 1) / p,
    "alltoall_": lambda p: (p - 1) / p,
    "_allgather_base_": lambda p: p - 1,
    "allgather_": lambda p: p - 1,
    "allgather_into_tensor_coalesced_": lambda p: p - 1,
    "_reduce_scatter_base_": lambda p: (p - 1) / p,
    "reduce_scatter_": lambda p: (p - 1) / p,
    "reduce_scatter_tensor_coalesced_": lambda p: (p - 1) / p,
    "allreduce_": lambda p: 2 * (p - 1) / p,
    "allreduce_coalesced_": lambda p: 2 * (p - 1) / p,
    "broadcast_": lambda p: 1.0,
    "send": lambda p: 1.0,
}


_SHAPE_INFERENCE = [0]  # > 0 while DTensor infers an op's global output shape


@contextlib.contextmanager
def dtensor_shape_inference_untracked() -> Iterator[None]:
    """DTensor infers each op's global output shape by running it on fake tensors of the global size, in the
    active fake mode (here: the planner's own), so torch's tracker would count them as memory. They are not:
    ops run while DTensor infers shapes bypass the tracker."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def inferring(self: Any, op_schema: Any) -> Any:
        _SHAPE_INFERENCE[0] += 1
        try:
            return original(self, op_schema)
        finally:
            _SHAPE_INFERENCE[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = inferring  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def _flop_registry() -> dict:
    """torch's FLOP formulas (``torch.utils.flop_counter``), plus the CPU flash-attention kernel a CPU trace runs
    (torch counts only the GPU ones): the same counts ``FlopCounterMode`` gives, without its extra mode."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def forward(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(q, k, v)

    def backward(g: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(g, q, k, v)

    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }
    return FlopCounterMode(display=False, custom_mapping=mapping).flop_registry


_INPUT_SECOND = ("alltoall_base_", "_allgather_base_", "_reduce_scatter_base_")  # (output, input, ...)
_SP_OPS = ("alltoall_base_", "alltoall_", "_allgather_base_", "allgather_", "send")


def _span(group: Any, size: int) -> int:
    """How many consecutive ranks ``group``'s ranks spread over (its size when they are adjacent; HSDP's replica
    groups are strided): a group whose span exceeds a node's GPUs crosses nodes (``hardware.step_seconds``)."""
    try:
        ranks = torch.distributed.get_process_group_ranks(group)
    except (RuntimeError, ValueError, KeyError):  # a group torch.distributed does not list: its ranks adjacent
        return size
    return max(ranks) - min(ranks) + 1 if ranks else size


def _key(category: Any) -> str:
    return str(category.value) if isinstance(category, Enum) else str(category)


def _parts(snapshot: dict) -> dict[str, int]:
    parts = dict.fromkeys(PARTS, 0)
    for category, nbytes in snapshot.items():
        part = _PART_OF.get(_key(category))
        if part is not None:
            parts[part] += int(nbytes)
    return parts


def _in_backward() -> bool:
    """Inside autograd's backward (activation checkpointing recomputes in there too)."""
    return torch._C._current_graph_task_id() != -1


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _no_module_backward_hook(tensors: Any, fn: Any, *, mode: str = "all") -> None:
    return None


class _PlaceRecorder:
    """Mixed into torch's trackers: per-place peaks (its own bookkeeping replaces the per-module snapshots, the
    trackers' slowest part) and the bytes each collective sends.

    Inside it, torch's ``ModTracker`` (the trackers' module bookkeeping) hooks no gradients. It follows modules
    through backward with ``register_multi_grad_hook`` on every module's inputs and outputs, and such a hook holds
    memory that a run without the tracker frees: (1) it buffers each gradient it sees until every hooked input
    has one, and a DiT's blocks share inputs (text and timestep embeddings) whose gradient is complete only after
    the last block's backward, so every block's input gradient lived until the end of backward (one activation
    per block: 0.36 GiB a block for Wan2.1-14B at Ulysses 2, checkpointed peaks 10% too high); (2) it is a
    reference cycle (its closure holds the ``grad_fn`` s it hooks, which hold it), so a graph that backward never
    runs (Qwen-Image's text stream after the last block, which the model drops) outlived its output, with what
    it saved, until the garbage collector happened to run (a few KiB per block that looked quadratic in the
    block count). The places need none of it: blocks and phases come from this class's own hooks and autograd's
    task id."""

    def __enter__(self) -> Any:
        # (a torch whose ModTracker no longer hooks through this name keeps its own; the shortcut test would show)
        self._multi_grad_hook = getattr(mod_tracker, "register_multi_grad_hook", None)
        if self._multi_grad_hook is not None:
            mod_tracker.register_multi_grad_hook = _no_module_backward_hook
        try:
            return super().__enter__()  # type: ignore[misc]
        except BaseException:
            self._restore_multi_grad_hook()
            raise

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)  # type: ignore[misc]
        finally:
            self._restore_multi_grad_hook()

    def _restore_multi_grad_hook(self) -> None:
        if self._multi_grad_hook is not None:
            mod_tracker.register_multi_grad_hook = self._multi_grad_hook

    def _init_places(self, model: torch.nn.Module, block_lists: dict[str, int]) -> None:
        self._flop_registry = _flop_registry()
        self.flops = 0
        self._after_bw = False
        self._running: tuple[str, int, int] | None = None  # the block running now (backward: the last begun)
        self._hooks: list[Any] = []
        for name, count in block_lists.items():
            for i, block in enumerate(getattr(model, name)):
                self._watch(block, (name, i, count))
        self._segments: list[list[Any]] = []  # [phase, block or None, peak total, snapshot]
        self._segment_key: tuple | None = None
        self.peak_total = 0
        self.comm: dict[tuple[str, int], float] = defaultdict(float)  # (kind, ranks spanned) -> bytes sent

    def _watch(self, block: torch.nn.Module, info: tuple[str, int, int]) -> None:
        """Forward hooks mark the block running; a hook on its outputs' gradients marks the start of its
        backward (which holds until the next block's backward begins; recomputation runs inside it)."""

        def begun(_: Any) -> None:
            self._running = info

        def pre(module: Any, args: Any) -> None:
            if not _in_backward():
                self._running = info

        def post(module: Any, args: Any, output: Any) -> None:
            if _in_backward():
                return
            self._running = None
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(begun)

        self._hooks += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _phase(self) -> str:
        if self._in_opt:
            return "opt"
        if _in_backward():
            self._after_bw = True
            return "bw"
        return "post" if self._after_bw else "fw"  # post: between backward and the optimizer (clipping)

    def _block(self) -> tuple[str, int, int] | None:
        return self._running

    def _current(self) -> tuple[int, dict]:
        total, merged = 0, {}
        for snap in self._curr_mem_snap.values():
            for category, nbytes in snap.items():
                if category == "Total":
                    total += nbytes
                else:
                    merged[category] = merged.get(category, 0) + nbytes
        return total, merged

    def _update_peak_stats(self, peak_state: Any) -> None:  # called by torch's tracker after every op
        phase = self._phase()
        key = (phase, self._block() if phase in ("fw", "bw") else None)
        total, _ = self._current()
        if key != self._segment_key:
            self._segment_key = key
            self._segments.append([key[0], key[1], -1, {}])
        segment = self._segments[-1]
        if total > segment[2]:
            segment[2] = total
            segment[3] = self._current()[1]
        self.peak_total = max(self.peak_total, total)

    def _count_collective(self, func: Any, args: tuple) -> None:
        name = func._schema.name.split("::")[-1]
        factor = _C10D_FACTOR.get(name)
        if factor is None:
            return
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        if boxed is None:
            return
        group = torch.distributed.ProcessGroup.unbox(boxed)
        size = int(group.size())
        if size <= 1:
            return
        tensors = _tensors(args[1] if name in _INPUT_SECOND else args[0])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sent = nbytes * factor(size)
        if name == "alltoall_base_" and len(args) > 4 and args[4]:
            # split sizes given (input_split_sizes, in rows of dim 0): all but this rank's own block leaves it
            # (sp_diffusers.parallel.exchange leaves the own block out of the collective where it can)
            sent = nbytes - int(args[4][group.rank()]) * (nbytes // max(1, int(tensors[0].shape[0])))
        # FSDP's own collectives, as FSDPMemTracker tells them apart: all-gathers before a forward or backward,
        # reduce-scatters after a backward; the rest move activations (SP) or a few scalars (other)
        state = str(getattr(self, "_fsdp_state", ""))
        fsdp = (name == "_allgather_base_" and ("PRE_FW" in state or "PRE_BW" in state)) or (
            name in ("_reduce_scatter_base_", "allreduce_") and "POST_BW" in state  # HSDP: all-reduce across
        )
        kind = "fsdp" if fsdp else "sp" if name in _SP_OPS else "other"
        self.comm[(kind, _span(group, size))] += sent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # a fake tensor's device query is dispatched as an op (prim.device), from C++, thousands of times a step;
        # it allocates nothing and a real tensor's never reaches a tracker, so it bypasses the bookkeeping
        if _SHAPE_INFERENCE[0] or func is DEVICE_QUERY:
            return func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and not any(t.__name__ == "DTensor" for t in types):
            self._count_collective(func, args)
        out = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]
        formula = self._flop_registry.get(func._overloadpacket)
        if formula is not None and out is not NotImplemented:
            self.flops += int(formula(*args, **(kwargs or {}), out_val=out))
        return out

    def start(self) -> None:
        """Mark the step's start: the memory held before any of its ops (parameters, optimizer state, inputs)."""
        total, snap = self._current()
        self._segments.append(["start", None, total, snap])
        self._segment_key = ("start", None)

    def places(self) -> dict[Place, dict[str, int]]:
        """Each place's peak, by part (``total`` included)."""
        out: dict[Place, dict[str, int]] = {}
        segments = self._segments
        for i, (phase, block, total, snap) in enumerate(segments):
            if phase == "start":
                keys: list[Place] = [("start",)]
            elif block is not None:
                keys = self._block_places(phase, block)
            else:  # a gap: it belongs to the next block of the same phase, else to the phase's end
                nxt = next((s for s in segments[i + 1 :] if s[0] != phase or s[1] is not None), None)
                if nxt is not None and nxt[0] == phase:
                    keys = self._block_places(phase, nxt[1])[:1]
                else:
                    keys = [(phase, "end")]
            parts = _parts(snap)
            parts["total"] = max(total, 0)
            for key in keys:
                if key not in out or parts["total"] > out[key]["total"]:
                    out[key] = dict(parts)
        return out

    @staticmethod
    def _block_places(phase: str, block: tuple[str, int, int]) -> list[Place]:
        name, index, count = block
        first = index == 0 if phase != "bw" else index == count - 1
        last = index == count - 1 if phase != "bw" else index == 0
        keys: list[Place] = []
        if first:
            keys.append((phase, name, "first"))
        if last:
            keys.append((phase, name, "last"))
        return keys or [(phase, name, "middle")]


class _FSDPPlaces(_PlaceRecorder, FSDPMemTracker):
    pass


class _Places(_PlaceRecorder, MemTracker):
    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> Any:
        # torch's tracker hooks every parameter's gradient, and a frozen one (LoRA's base) refuses a hook:
        # track all of them, hook the trainable ones only
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._grad_seen),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_seen(p.grad)),
                    )
        return sizes

    def _grad_seen(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, self._ref_class.GRAD)  # type: ignore[attr-defined]


def make_tracker(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    block_lists: dict[str, int],
    inputs: tuple[torch.Tensor, ...] = (),
) -> _PlaceRecorder:
    """A place-recording ``FSDPMemTracker`` for a sharded model, else a ``MemTracker``; either tracks the model,
    the optimizer and the step's ``inputs`` (``block_lists``: the model's block lists and their lengths)."""
    if isinstance(model, FSDPModule):
        tracker: Any = _FSDPPlaces(model, optimizer)
        tracker.track_inputs(inputs)
    else:
        tracker = _Places()
        tracker.track_external(model, *(o for o in (optimizer,) if o is not None), *inputs)
    tracker._init_places(model, block_lists)
    return tracker
