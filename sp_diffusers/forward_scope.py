"""What one model forward knows about every rank's sequence lengths, so attention calls need not ask.

A plan splits *global* inputs (``torch.tensor_split``'s rule): at the split every rank knows every rank's
length of that input without communicating. A :class:`ForwardScope`, opened by a forward pre-hook on the
model and closed by its post-hook (``sp_diffusers.scope_hooks``), records each split by name. Inside it:

- **even** forward (every split so far divides the sequence-parallel degree): every rank holds the same
  local lengths, so every call's per-rank sizes are its own local lengths repeated - nothing is exchanged.
  This rests on one property of the model: every sequence a call sees is made of split streams and of
  streams every rank holds whole; ``debug_checks`` (mode ``"per_call"``) verifies it call by call.
- **uneven** forward: the per-rank sizes of a call depend on which streams make up its sequence, which no
  rank can tell from its own length (the last rank holds ``floor(N/P)`` of every stream). They are learned
  once - the per-call handshake of the first forward with that input signature and split record - and read
  back by call index in every later forward: the decision is taken on every rank from the same facts (the
  agreed signature, the split lengths, the call index), so the ranks never disagree on whether to exchange.

Activation checkpointing recomputes blocks during backward, outside any scope. Each grad-enabled forward
marks its outputs; when backward reaches them the scope becomes *active* until that backward ends, and a
recomputed call finds its sizes among the active scopes' calls by its own local lengths - only where that
local view names one call's layout on every rank (a layout whose local view no other layout shares on any
rank: every rank can check that, from the same list). Otherwise, and for calls outside any model forward
(direct calls of the backend), the call falls back to the per-call handshake, on every rank alike.

Modes (per model, :func:`set_rank_agreement`): ``"per_forward"`` (default; one agreement of the inputs per
forward), ``"trusted"`` (the caller guarantees identical inputs on every rank of the SP group: no
agreement; automatic on torch's fake process group, where a collective moves no data) and ``"per_call"``
(debug: the full per-call handshake on every call as well).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from .comm import gather_ints

__all__ = [
    "MODES",
    "ForwardScope",
    "current",
    "mark_outputs",
    "piece_sizes",
    "rank_agreement",
    "replay",
    "set_rank_agreement",
    "stream_sizes",
]

MODES = ("per_forward", "trusted", "per_call")
_MODE_ATTR = "_sp_diffusers_rank_agreement"
_BOOK_SIZE = 4096  # remembered (signature, splits, call) layouts; LRU, the same on every rank
_book: OrderedDict[Hashable, Any] = OrderedDict()
_local = threading.local()
_active: list[weakref.ref] = []  # scopes whose backward is running (for recomputed calls)


def set_rank_agreement(model: torch.nn.Module, mode: str) -> None:
    """How the ranks of ``model``'s SP group agree on each forward's inputs (see the module docstring).

    ``"trusted"`` skips the one collective and host sync per forward: use it only where every rank of the SP
    group is guaranteed the same inputs (``FSDPEngine`` broadcasts its micro-batch) - inputs that differ
    would then hang the group or mix two batches. ``"per_call"`` is ``debug_checks``.
    """
    if mode not in MODES:
        raise ValueError(f"set_rank_agreement: mode={mode!r} is not one of {MODES}")
    setattr(model, _MODE_ATTR, mode)


def rank_agreement(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> str:
    """``model``'s mode; ``"trusted"`` on torch's fake process group unless ``"per_call"`` was set."""
    mode = getattr(model, _MODE_ATTR, "per_forward")
    if mode == "per_forward" and group is not None and _fake(group):
        return "trusted"
    return mode


def _fake(group: dist.ProcessGroup) -> bool:
    """torch's fake process group (``"fake"``, or per device, ``"cpu:fake,meta:fake"``): it moves no data."""
    backends = str(dist.get_backend(group)).split(",")
    return all(b.rsplit(":", 1)[-1] == "fake" for b in backends)


class ForwardScope:
    """One model forward under context parallelism: its splits, its calls' layouts, its mode."""

    def __init__(self, config: Any, world: int, rank: int, mode: str, signature: Hashable) -> None:
        self.config, self.world, self.rank, self.mode = config, world, rank, mode
        self.signature = signature
        self.plan_keys: dict[int, str] = {}  # id(plan entry) -> its key, to name splits
        self.splits: dict[str, tuple[int, ...]] = {}
        self.split_key: tuple = ()
        self.even = True
        self.layouts: dict[str, list[Any]] = {}  # kind -> every call's layout, in call order
        self._next: dict[str, int] = {}

    # ------------------------------------------------------------------ splits
    def record_split(self, name: str, total: int) -> None:
        """A plan split ``total`` positions of ``name`` over the SP group (``torch.tensor_split``'s rule)."""
        sizes = tuple(total // self.world + (r < total % self.world) for r in range(self.world))
        if self.splits.get(name) != sizes:
            self.splits[name] = sizes
            self.split_key = (*self.split_key, (name, total))
            self.even = self.even and total % self.world == 0

    # ------------------------------------------------------------------ calls
    def next_call(self, kind: str) -> Hashable:
        """The book key of this forward's next call of ``kind``: identical on every rank."""
        j = self._next.get(kind, 0)
        self._next[kind] = j + 1
        return (self.signature, self.split_key, kind, j)

    def add(self, kind: str, layout: Any) -> None:
        self.layouts.setdefault(kind, []).append(layout)


def remembered(key: Hashable) -> Any | None:
    layout = _book.get(key)
    if layout is not None:
        _book.move_to_end(key)
    return layout


def remember(key: Hashable, layout: Any) -> None:
    _book[key] = layout
    _book.move_to_end(key)
    while len(_book) > _BOOK_SIZE:
        _book.popitem(last=False)


# ---------------------------------------------------------------------- the scope stack (per thread)
def _stack() -> list[ForwardScope]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def push(scope: ForwardScope) -> None:
    _stack().append(scope)


def pop(scope: ForwardScope) -> None:
    stack = _stack()
    if scope in stack:
        del stack[stack.index(scope) :]


def current(config: Any = None) -> ForwardScope | None:
    """The innermost open scope (of ``config``'s model when given), or None outside a model forward."""
    for scope in reversed(_stack()):
        if config is None or scope.config is config:
            return scope
    return None


# ---------------------------------------------------------------------- backward: active scopes
class _ScopeMark(torch.autograd.Function):
    """Identity on a model output; its backward runs before any recomputation inside that forward (the
    output is the only way gradients enter it) and makes the forward's scope active until backward ends."""

    @staticmethod
    def forward(ctx, scope: ForwardScope, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.scope = scope
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        scope = ctx.scope
        if all(ref() is not scope for ref in _active):
            ref = weakref.ref(scope)
            _active.append(ref)

            def done() -> None:
                if ref in _active:
                    _active.remove(ref)

            torch.autograd.Variable._execution_engine.queue_callback(done)
        return None, grad


def mark_outputs(scope: ForwardScope, output: Any) -> Any:
    """``output`` with every tensor that requires grad passed through :class:`_ScopeMark` (same structure)."""

    def mark(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _ScopeMark.apply(scope, x) if x.requires_grad else x
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(mark(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(mark(v) for v in x)
        if isinstance(x, dict):  # diffusers' BaseOutput is an OrderedDict dataclass
            values = {k: mark(v) for k, v in x.items()}
            try:
                return type(x)(**values)
            except TypeError:
                return type(x)(values)
        return x

    return mark(output)


def _active_scopes(config: Any, world: int | None = None) -> list[ForwardScope]:
    scopes = [ref() for ref in _active]
    return [
        s
        for s in scopes
        if s is not None and (config is None or s.config is config) and (world is None or s.world == world)
    ]


def replay(
    config: Any, kind: str, view: Callable[[Any, int], Hashable], local: Hashable, world: int | None = None
) -> Any | None:
    """The layout of a call outside any forward (a recomputed one): the one active layout whose local view on
    this rank is ``local``, if no other active layout shares its local view on any rank; else None (the
    caller then runs the per-call handshake - every rank reaches the same verdict from the same list)."""
    scopes = _active_scopes(config, world)
    if not scopes or any(s.mode == "per_call" for s in scopes):
        return None
    layouts = list(dict.fromkeys(layout for s in scopes for layout in s.layouts.get(kind, ())))
    rank, world = scopes[0].rank, scopes[0].world
    found = [layout for layout in layouts if view(layout, rank) == local]
    if len(found) != 1:
        return None
    (mine,) = found
    for r in range(world):
        if any(other != mine and view(other, r) == view(mine, r) for other in layouts):
            return None
    return mine


def _named(scope: ForwardScope, name: str) -> tuple[int, ...] | None:
    """The split ``name`` (``"<plan key>:<input>"``), or - for ``":<input>"`` - the one split of that input
    under any plan key (all of them the same sizes)."""
    if name in scope.splits:
        return scope.splits[name]
    if name.startswith(":"):
        found = {sizes for n, sizes in scope.splits.items() if n.endswith(name)}
        if len(found) == 1:
            return found.pop()
    return None


def stream_sizes(config: Any, names: list[str]) -> list[list[int]] | None:
    """Every rank's lengths of the named splits (a plan's streams), from the open scope or, in a recomputed
    call, from the active scopes if they all agree; None where neither knows (the caller then gathers -
    every rank alike: the scopes and their splits are the same on every rank)."""
    scope = current(config)
    candidates = [scope] if scope is not None else _active_scopes(config)
    found = None
    for s in candidates:
        sizes = [_named(s, n) for n in names]
        if any(x is None for x in sizes):
            return None
        listed = [list(x) for x in sizes]
        if found is not None and listed != found:
            return None
        found = listed
    return found


def piece_sizes(group: dist.ProcessGroup, length: int, device: torch.device) -> list[int]:
    """Every rank's length of the pieces a plan's output gather joins (``length`` = this rank's): from the open
    scope as attention gets its sizes, else gathered (one collective and a host sync)."""
    world = dist.get_world_size(group)
    scope = current()
    if scope is not None and scope.world != world:
        scope = None
    if scope is None:
        found = replay(None, "gather", lambda sizes, r: sizes[r], length, world)
        return list(found) if found is not None else _gather_lengths(group, length, device)
    if scope.even and scope.mode != "per_call":
        sizes = (length,) * world
    else:
        key = scope.next_call("gather")
        sizes = remembered(key) if scope.mode != "per_call" else None
        if sizes is None:
            sizes = tuple(_gather_lengths(group, length, device))
            remember(key, sizes)
        elif sizes[scope.rank] != length:
            raise ValueError(
                f"sp_diffusers: an output gather holds {length} positions on this rank, {sizes[scope.rank]} in an "
                "earlier forward with the same input shapes; fix: sp_diffusers.set_rank_agreement(model, 'per_call')"
            )
    scope.add("gather", sizes)
    return list(sizes)


def _gather_lengths(group: dist.ProcessGroup, length: int, device: torch.device) -> list[int]:
    return [row[0] for row in gather_ints([length], group, device)]
