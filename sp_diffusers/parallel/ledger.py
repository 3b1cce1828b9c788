"""The communication ledger: every collective this process issues, counted by phase and kind (calls and bytes).

While a :class:`CommLedger` records (``with ledger.recording():``), the collectives of ``torch.distributed`` and
of its functional twins (``torch.distributed._functional_collectives``: diffusers' gathers, DTensor's reductions)
pass through thin wrappers that add one entry each: no tensor is read, nothing is synchronised, and outside a
recording the functions are torch's own. Object collectives (``all_gather_object`` and friends) are counted as
the tensor collectives they issue inside. A compiled graph calls the c10d functional ops past these wrappers: its
collectives are listed once from the graph (:func:`graph_collectives`, the same byte rules on its static shapes)
and added each time it runs (:func:`count_graph`; ``sp_diffusers.engine.compiling.counting_backend``).

Phase: what the process is doing, named by the innermost :func:`comm_phase` (``"other"`` outside any):

    batch          the micro-batch broadcast to the SP group        rollout        the denoising steps
    old_log_probs  the rollout's log-probs recomputed               reward         scoring, its gathers
    reference      the KL reference forward (adapters off)          train_forward  the policy's loss
    train_backward its backward                                      optimizer      norms, replica syncs
    eval           evaluation and sample grids                       checkpoint     writing / reading one

Kind: what moves, named by the innermost :func:`comm_kind`, else by the collective:

    param_gather   FSDP all-gathers of parameters (``unshard``)     grad_reduce    FSDP reduce-scatters, the HSDP
                                                                                   all-reduce, replica syncs
    activation     all-to-alls, ring sends, sequence / mask gathers data           a batch or rewards moved
    agreement      small exchanges: flags, lengths, norms, objects

Bytes: what one rank puts on its link, as NCCL's tests define bus bandwidth, so that one figure per kind compares
with a link's speed: all-gather ``S (P-1)/P`` of the gathered output S, reduce-scatter ``S (P-1)/P`` of its input,
all-reduce ``2 S (P-1)/P``, all-to-all what leaves the rank (its input less the block it keeps: exact for uneven
splits), broadcast and point-to-point sends ``S``; P is the group's size and a group of one moves nothing.
Integer arithmetic, so a fake-tensor run of the same code (the planner) predicts the same bytes exactly.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "KINDS",
    "PHASES",
    "CommLedger",
    "active_ledger",
    "comm_kind",
    "comm_phase",
    "count_graph",
    "graph_collectives",
]

PHASES = (
    "batch",
    "rollout",
    "old_log_probs",
    "reward",
    "reference",
    "train_forward",
    "train_backward",
    "optimizer",
    "eval",
    "checkpoint",
    "other",
)
KINDS = ("param_gather", "grad_reduce", "activation", "data", "agreement")


class _State:
    """Process-wide, not per thread: on CUDA, backward (FSDP's reduce-scatters, the exchange's backward) runs on
    autograd's device thread while the thread that called ``backward()`` waits inside its phase."""

    def __init__(self) -> None:
        self.ledger: CommLedger | None = None
        self.phases: list[str] = []
        self.kinds: list[str] = []
        self.inside = False  # a counted collective is running: what it calls inside is not counted again


_state = _State()


def _stack(name: str) -> list[str]:
    return getattr(_state, name)


@contextlib.contextmanager
def comm_phase(phase: str) -> Iterator[None]:
    """Collectives inside are counted under ``phase`` (one of :data:`PHASES`); cheap when nothing records."""
    if phase not in PHASES:
        raise ValueError(f"comm_phase({phase!r}): not a ledger phase; one of {', '.join(PHASES)}")
    stack = _stack("phases")
    stack.append(phase)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def comm_kind(kind: str) -> Iterator[None]:
    """Collectives inside are counted as ``kind`` (one of :data:`KINDS`) whatever their function."""
    if kind not in KINDS:
        raise ValueError(f"comm_kind({kind!r}): not a ledger kind; one of {', '.join(KINDS)}")
    stack = _stack("kinds")
    stack.append(kind)
    try:
        yield
    finally:
        stack.pop()


class CommLedger:
    """Calls and bytes per ``(phase, kind)``; ``take()`` returns them and starts afresh (one iteration's worth)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[int]] = {}

    def add(self, kind: str, nbytes: int) -> None:
        phases, kinds = _stack("phases"), _stack("kinds")
        key = (phases[-1] if phases else "other", kinds[-1] if kinds else kind)
        entry = self.entries.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += int(nbytes)

    def take(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(phase, kind): (calls, bytes)}`` since the last ``take()``, and zero again."""
        out = {k: (v[0], v[1]) for k, v in self.entries.items()}
        self.entries = {}
        return out

    @contextlib.contextmanager
    def recording(self) -> Iterator[CommLedger]:
        """Count every collective issued inside (nested recordings: the innermost ledger counts)."""
        previous = _state.ledger
        _install()
        _state.ledger = self
        try:
            yield self
        finally:
            _state.ledger = previous
            _uninstall()


def active_ledger() -> CommLedger | None:
    return _state.ledger


def as_metrics(entries: dict[tuple[str, str], tuple[int, int]], prefix: str = "comm") -> dict[str, float]:
    """Flat metrics of a ledger's entries: ``comm/<phase>/<kind>_calls`` and ``_bytes``, and the totals."""
    out: dict[str, float] = {}
    for (phase, kind), (calls, nbytes) in sorted(entries.items()):
        out[f"{prefix}/{phase}/{kind}_calls"] = float(calls)
        out[f"{prefix}/{phase}/{kind}_bytes"] = float(nbytes)
    out[f"{prefix}/calls"] = float(sum(c for c, _ in entries.values()))
    out[f"{prefix}/bytes"] = float(sum(b for _, b in entries.values()))
    return out


# ----------------------------------------------------------------------------------------------- the bytes


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _size(group: Any) -> int:
    """The size of a group as torch.distributed or the functional collectives name it."""
    if group is None:
        return dist.get_world_size()
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    if isinstance(group, (list, tuple)) and group and isinstance(group[0], int):
        return len(group)
    if isinstance(group, tuple):  # (DeviceMesh, mesh dim)
        return group[0].size(group[1])
    if hasattr(group, "size") and hasattr(group, "mesh"):  # a 1-D DeviceMesh
        return group.size()
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group).size()


def _rank(group: Any) -> int:
    if group is None or isinstance(group, dist.ProcessGroup):
        return dist.get_rank(group)
    if isinstance(group, tuple) and not isinstance(group[0], int):
        return group[0].get_local_rank(group[1])
    from torch.distributed._functional_collectives import _resolve_group_name
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_rank(_resolve_process_group(_resolve_group_name(group)))


def _gather(total: int, p: int) -> int:
    return total * (p - 1) // p


def _a2a(inp: torch.Tensor, splits: Any, group: Any) -> int:
    """Bytes of an all-to-all's input that leave the rank (its own block stays)."""
    p = _size(group)
    if p <= 1:
        return 0
    total = _nbytes(inp)
    if not splits:
        return _gather(total, p)
    row = total // max(1, inp.shape[0]) if inp.dim() else 0
    return total - int(splits[_rank(group)]) * row


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


# Each counted function: (its default kind, bytes of a call from (args, kwargs)).
_Rule = tuple[str, Callable[[tuple, dict], int]]


def _sized(
    fn: Callable[[Any, int], int], tensor_at: int, tensor_name: str, group_at: int
) -> Callable[[tuple, dict], int]:
    def nbytes(args: tuple, kwargs: dict) -> int:
        p = _size(_arg(args, kwargs, group_at, "group"))
        return fn(_arg(args, kwargs, tensor_at, tensor_name), p) if p > 1 else 0

    return nbytes


def _list_gather(args: tuple, kwargs: dict) -> int:
    p = _size(_arg(args, kwargs, 2, "group"))
    parts = _arg(args, kwargs, 0, "tensor_list") or []
    return _all_gather_bytes(sum(_nbytes(t) for t in parts) // p, p) if p > 1 else 0


def _p2p_batch(args: tuple, kwargs: dict) -> int:
    # isend / irecv themselves stay torch's: P2POp checks their identity (the ring's sends go through here)
    ops = _arg(args, kwargs, 0, "p2p_op_list") or []
    return sum(_nbytes(op.tensor) for op in ops if getattr(op.op, "__name__", "") == "isend")


def _dist_rules() -> dict[str, _Rule]:
    return {
        "all_to_all_single": (
            "activation",
            lambda a, k: _a2a(
                _arg(a, k, 1, "input"), _arg(a, k, 3, "input_split_sizes"), _arg(a, k, 4, "group")
            ),
        ),
        "all_gather": ("activation", _list_gather),
        "all_gather_into_tensor": (
            "activation",
            _sized(lambda t, p: _all_gather_bytes(_nbytes(t) // p, p), 0, "output_tensor", 2),
        ),
        "all_gather_single": (
            "activation",
            _sized(lambda t, p: _all_gather_bytes(_nbytes(t) // p, p), 0, "output_tensor", 2),
        ),
        "reduce_scatter_tensor": ("activation", _sized(lambda t, p: _reduce_scatter_bytes(_nbytes(t), p), 1, "input", 3)),
        "reduce_scatter_single": ("activation", _sized(lambda t, p: _reduce_scatter_bytes(_nbytes(t), p), 1, "input", 3)),
        "all_reduce": ("agreement", _sized(lambda t, p: _all_reduce_bytes(_nbytes(t), p), 0, "tensor", 2)),
        "broadcast": ("data", _sized(lambda t, p: _broadcast_bytes(_nbytes(t), p), 0, "tensor", 2)),
        "batch_isend_irecv": ("activation", _p2p_batch),
        "barrier": ("agreement", lambda a, k: 0),
    }


def _all_gather_bytes(piece: int, p: int) -> int:
    """An all-gather of ``piece`` bytes from each of ``p`` ranks."""
    return _gather(piece * p, p) if p > 1 else 0


def _reduce_scatter_bytes(total: int, p: int) -> int:
    """A reduce-scatter of a ``total``-byte input."""
    return _gather(total, p) if p > 1 else 0


def _all_reduce_bytes(total: int, p: int) -> int:
    return 2 * _gather(total, p) if p > 1 else 0


def _broadcast_bytes(total: int, p: int) -> int:
    return total if p > 1 else 0


def _funcol_rules() -> dict[str, _Rule]:
    def gathered(a: tuple, k: dict) -> int:
        return _all_gather_bytes(_nbytes(_arg(a, k, 0, "self")), _size(_arg(a, k, 2, "group")))

    def scattered(a: tuple, k: dict) -> int:
        return _reduce_scatter_bytes(_nbytes(_arg(a, k, 0, "self")), _size(_arg(a, k, 3, "group")))

    def reduced(a: tuple, k: dict) -> int:
        return _all_reduce_bytes(_nbytes(_arg(a, k, 0, "self")), _size(_arg(a, k, 2, "group")))

    def a2a(a: tuple, k: dict) -> int:
        return _a2a(_arg(a, k, 0, "self"), _arg(a, k, 2, "input_split_sizes"), _arg(a, k, 3, "group"))

    rules: dict[str, _Rule] = {}
    for name in (
        "all_gather_single",
        "all_gather_single_autograd",
        "all_gather_tensor",
        "all_gather_tensor_autograd",
    ):
        rules[name] = ("activation", gathered)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd"):
        rules[name] = ("activation", scattered)
    rules["all_reduce"] = ("agreement", reduced)
    rules["all_to_all_single"] = ("activation", a2a)
    rules["all_to_all_single_autograd"] = ("activation", a2a)
    rules["broadcast"] = (
        "data",
        lambda a, k: _broadcast_bytes(_nbytes(_arg(a, k, 0, "self")), _size(_arg(a, k, 2, "group"))),
    )
    return rules


# ------------------------------------------------------------------- collectives inside compiled graphs


def _graph_rules() -> dict[str, _Rule]:
    """The ops of ``torch.ops._c10d_functional`` (what a traced collective becomes in a graph) by name, each with
    the kind and the bytes of the Python function that issues it eagerly, from the op's schema arguments
    (tensors: the graph's fake tensors, ``node.meta["val"]``; groups: by name)."""

    def total(tensors: Any) -> int:
        return sum(_nbytes(t) for t in tensors)

    return {
        "all_to_all_single": ("activation", lambda a, k: _a2a(a[0], a[2], a[3])),
        "all_gather_into_tensor": ("activation", lambda a, k: _all_gather_bytes(_nbytes(a[0]), _size(a[2]))),
        "all_gather_into_tensor_coalesced": (
            "activation",
            lambda a, k: _all_gather_bytes(total(a[0]), _size(a[2])),
        ),
        "reduce_scatter_tensor": ("activation", lambda a, k: _reduce_scatter_bytes(_nbytes(a[0]), _size(a[3]))),
        "reduce_scatter_tensor_coalesced": (
            "activation",
            lambda a, k: _reduce_scatter_bytes(total(a[0]), _size(a[3])),
        ),
        "all_reduce": ("agreement", lambda a, k: _all_reduce_bytes(_nbytes(a[0]), _size(a[2]))),
        "all_reduce_coalesced": ("agreement", lambda a, k: _all_reduce_bytes(total(a[0]), _size(a[2]))),
        "broadcast": ("data", lambda a, k: _broadcast_bytes(_nbytes(a[0]), _size(a[2]))),
    }


_UNKNOWN: set[str] = set()  # graph collectives warned about


def graph_collectives(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """``(kind, bytes)`` of every collective ``gm`` (a graph after AOT autograd) issues per run, in graph order:
    what one run adds to the active ledger (:func:`count_graph`). Sizes come from the graph's static shapes.
    A collective the rules do not know is warned about once and left out (a metric never stops a run)."""
    rules = _graph_rules()
    out: list[tuple[str, int]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace not in ("_c10d_functional", "_c10d_functional_autograd"):
            continue
        name = node.target._opname
        if name in ("wait_tensor",):
            continue
        if name not in rules:
            if name not in _UNKNOWN:
                _UNKNOWN.add(name)
                warnings.warn(
                    f"the communication ledger has no byte rule for the graph collective {node.target}: its calls "
                    "are not counted in comm/* metrics",
                    stacklevel=2,
                )
            continue
        kind, nbytes = rules[name]
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
        out.append((kind, nbytes(args, {})))
    return out


def count_graph(entries: list[tuple[str, int]]) -> None:
    """Add one run of a compiled graph's collectives (:func:`graph_collectives`) to the recording ledger, under
    the phase and kind open now, as eager calls would be counted; nothing when no ledger records."""
    ledger = _state.ledger
    if ledger is None or _state.inside:
        return
    for kind, nbytes in entries:
        ledger.add(kind, nbytes)


_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def _counted(fn: Callable, kind: str, nbytes: Callable[[tuple, dict], int]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ledger = _state.ledger
        # one count per collective: a deprecated alias calling its successor, or dynamo tracing, counts nothing more
        if ledger is None or _state.inside or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        ledger.add(kind, nbytes(args, kwargs))
        _state.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _state.inside = False

    wrapper.__sp_ledger_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _of_kind(fn: Callable, kind: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with comm_kind(kind):
            return fn(*args, **kwargs)

    wrapper.__sp_ledger_original__ = fn  # type: ignore[attr-defined]
    return wrapper


_installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) while recordings are open
_depth = [0]
_lock = threading.Lock()


def _patch(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name, None)
    if original is None or hasattr(original, "__sp_ledger_original__"):
        return
    _installed.append((owner, name, original))
    setattr(owner, name, wrap(original))


def _fsdp_modules() -> list[Any]:
    """FSDP2's module that calls its collectives by name (``foreach_all_gather``, ``foreach_reduce``); [] when
    this torch has none (then FSDP's collectives count under their functions' default kinds)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [_fsdp_param_group]


def _install() -> None:
    with _lock:
        _depth[0] += 1
        if _depth[0] > 1:
            return
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        # torch.distributed's names and c10d's module globals (its object collectives call those)
        for name, (kind, nbytes) in _dist_rules().items():
            for owner in (dist, c10d):
                _patch(owner, name, lambda fn, kind=kind, nbytes=nbytes: _counted(fn, kind, nbytes))
        for name, (kind, nbytes) in _funcol_rules().items():
            _patch(funcol, name, lambda fn, kind=kind, nbytes=nbytes: _counted(fn, kind, nbytes))
        for name in _OBJECT_COLLECTIVES:
            for owner in (dist, c10d):
                _patch(owner, name, lambda fn: _of_kind(fn, "agreement"))
        for module in _fsdp_modules():
            _patch(module, "foreach_all_gather", lambda fn: _of_kind(fn, "param_gather"))
            _patch(module, "foreach_reduce", lambda fn: _of_kind(fn, "grad_reduce"))


def _uninstall() -> None:
    with _lock:
        _depth[0] -= 1
        if _depth[0] > 0:
            return
        while _installed:
            owner, name, original = _installed.pop()
            setattr(owner, name, original)
