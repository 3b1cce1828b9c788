"""What the ranks of a sequence-parallel group agree on before attention moves any data, and when.

Every collective of the Ulysses exchange assumes its peers call it with matching arguments: a rank with a mask
while its peer has none, another batch or head count, ``is_causal`` on one rank only, or a local error that one
rank raises while the others enter the all-to-all, would hang the group or silently mix two attentions.

**Per call: the handshake** (:func:`agree`). One small all-gather of what each rank is about to do (shapes,
dtype, mask form, flags, its local error if any): every rank sees the same table and either proceeds, with every
rank's sequence lengths (uneven shards need them for the split sizes), or raises the same error, naming the
input, the ranks and their values. For calls outside a model forward (direct calls of the backend) and for
``debug_checks``.

**Once per forward: the scope** (:class:`ForwardScope`). At the model's entry the ranks compare one digest of
the model and of every input's shape, dtype and value (:func:`agree_forward`: one collective and one host sync
per forward; a mismatch names the input and the ranks). A plan splits *global* inputs by ``torch.tensor_split``'s
rule, so at the split every rank knows every rank's length without communicating. The scope, opened by a
forward pre-hook on the model and closed by its post-hook (``sp_diffusers.patching.scope_hooks``), records each
split by name. Inside it:

- **even** forward (every split so far divides the sequence-parallel degree): every rank holds the same
  local lengths, so every call's per-rank sizes are its own local lengths repeated - nothing is exchanged.
  This rests on one property of the model: every sequence a call sees is made of split streams and of
  streams every rank holds whole; ``debug_checks`` (mode ``"per_call"``) verifies it call by call.
- **uneven** forward: the per-rank sizes of a call depend on which streams make up its sequence, which no
  rank can tell from its own length (the last rank holds ``floor(N/P)`` of every stream). They are learned
  once - the handshake of the first forward with that input signature and split record - and read back by
  call index in every later forward: the decision is taken on every rank from the same facts (the agreed
  signature, the split lengths, the call index), so the ranks never disagree on whether to exchange.

Activation checkpointing recomputes blocks during backward, outside any scope. Each grad-enabled forward
marks its outputs; when backward reaches them the scope becomes *active* until that backward ends, and a
recomputed call finds its sizes among the active scopes' calls by its own local lengths - only where that
local view names one call's layout on every rank (a layout whose local view no other layout shares on any
rank: every rank can check that, from the same list). Otherwise the call falls back to the handshake, on every
rank alike.

Modes (per model, :func:`set_rank_agreement`): ``"per_forward"`` (default; one agreement of the inputs per
forward), ``"trusted"`` (the caller guarantees identical inputs on every rank of the SP group: no
agreement; automatic on torch's fake process group, where a collective moves no data) and ``"per_call"``
(debug: the handshake on every call as well).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .gathers import gather_ints
from .ledger import comm_kind

__all__ = [
    "MODES",
    "CallLayout",
    "ForwardScope",
    "SPCallMismatch",
    "agree",
    "agree_forward",
    "compilable",
    "current",
    "describe",
    "layout_by_view",
    "mark_outputs",
    "piece_sizes",
    "rank_agreement",
    "replay",
    "set_rank_agreement",
    "stream_sizes",
]


# ---------------------------------------------------------------------------------------------- the handshake

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool)
# field name -> (what it is, the fix when ranks disagree)
_MUST_AGREE = {
    "batch": ("the batch size of query", "every rank of an SP group must run the same micro-batch"),
    "heads": ("the number of query heads", "every rank must run the same model"),
    "kv_heads": ("the number of key/value heads", "every rank must run the same model"),
    "head_dim": ("the head dim", "every rank must run the same model"),
    "dtype": ("the dtype of query/key/value", "cast every rank's inputs to one dtype"),
    "mask": (
        "whether attn_mask is given, its shape form and dtype",
        "pass the same kind of mask on every rank",
    ),
    "is_causal": ("is_causal", "pass the same is_causal on every rank"),
    "dropout_p": ("dropout_p", "pass the same dropout_p on every rank"),
    "scale": ("scale", "pass the same scale on every rank"),
}


class SPCallMismatch(ValueError):
    """The ranks of an SP group called attention with disagreeing inputs (raised on every rank)."""


@dataclass(frozen=True)
class CallLayout:
    """Every rank's local lengths, in the context-parallel group's rank order, and the mask's raw shapes."""

    q_sizes: tuple[int, ...]
    kv_sizes: tuple[int, ...]
    mask_shapes: tuple[tuple[int, ...], ...] | None  # each rank's attn_mask shape (None: no mask anywhere)

    def view(self, rank: int) -> tuple:
        """What ``rank`` sees of this layout on its own: its lengths and its mask's shape."""
        return (
            self.q_sizes[rank],
            self.kv_sizes[rank],
            None if self.mask_shapes is None else self.mask_shapes[rank],
        )


def _float_bits(x: float | None) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + hash(str(dtype)) % 1000


def agree(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    local_error: str | None,
    group: dist.ProcessGroup,
) -> CallLayout:
    """One all-gather over ``group``: raise the same error on every rank when any rank failed locally or the
    ranks disagree; else every rank's lengths. ``query``/``key`` are ``[B, S_local, H, D]`` (4-D when
    ``local_error`` is None)."""
    four_d = query.dim() == 4 and key.dim() == 4
    mask_shape = list(attn_mask.shape) if attn_mask is not None else []
    row = [
        int(local_error is not None),
        *(query.shape[:1] if four_d else [-1]),
        query.shape[1] if four_d else -1,
        key.shape[1] if four_d else -1,
        query.shape[2] if four_d else -1,
        key.shape[2] if four_d else -1,
        query.shape[3] if four_d else -1,
        _code(query.dtype),
        len(mask_shape) if attn_mask is not None else -1,
        *(mask_shape + [0] * (4 - len(mask_shape)))[:4],
        _code(attn_mask.dtype) if attn_mask is not None else -1,
        int(bool(is_causal)),
        _float_bits(dropout_p),
        _float_bits(scale),
    ]
    table = gather_ints(row, group, query.device)
    ranks = dist.get_process_group_ranks(group)
    failed = [i for i, r in enumerate(table) if r[0]]
    if failed:
        messages: list[str | None] = [None] * len(table)
        dist.all_gather_object(messages, local_error, group=group)
        details = "; ".join(f"rank {ranks[i]}: {messages[i]}" for i in failed)
        raise SPCallMismatch(
            f"ulysses_sdpa: {len(failed)} rank(s) of the SP group refused the call: {details}"
        )
    columns = {
        "batch": [r[1] for r in table],
        "heads": [r[4] for r in table],
        "kv_heads": [r[5] for r in table],
        "head_dim": [r[6] for r in table],
        "dtype": [str(_DTYPES[r[7]]) if r[7] < len(_DTYPES) else r[7] for r in table],
        "mask": [
            "none" if r[8] < 0 else f"{r[8]}-D {'bool' if r[13] == _DTYPES.index(torch.bool) else 'additive'}"
            for r in table
        ],
        "is_causal": [bool(r[14]) for r in table],
        "dropout_p": [r[15] for r in table],
        "scale": [r[16] for r in table],
    }
    for name, values in columns.items():
        if len({str(v) for v in values}) > 1:
            what, fix = _MUST_AGREE[name]
            shown = values
            if name in ("dropout_p", "scale"):
                shown = [None if v == -1 else struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
            per_rank = ", ".join(f"rank {ranks[i]}: {v}" for i, v in enumerate(shown))
            raise SPCallMismatch(
                f"ulysses_sdpa: the ranks of the SP group disagree on {what} ({per_rank}); fix: {fix}"
            )
    mask_shapes = None
    if table[0][8] >= 0:
        mask_shapes = tuple(tuple(r[9 : 9 + r[8]]) for r in table)
    return CallLayout(tuple(r[2] for r in table), tuple(r[3] for r in table), mask_shapes)


def describe(name: str, value: Any, out: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """``(name, description)`` of every leaf of a forward input, containers flattened into dotted names:
    tensors by shape, dtype and device type (not device index, not values), plain values as they are, other
    objects by type. Rank-independent, so that every rank of an SP group describes the same inputs alike."""
    out = [] if out is None else out
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        out.append((name, f"tensor{list(value.shape)} {dtype} on {value.device.type}"))
    elif isinstance(value, dict):
        if not value:
            out.append((name, "{}"))
        for k, v in value.items():
            describe(f"{name}.{k}", v, out)
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append((name, repr(value)))
        for i, v in enumerate(value):
            describe(f"{name}[{i}]", v, out)
    elif value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        out.append((name, repr(value)))
    else:
        out.append((name, f"a {type(value).__name__}"))
    return out


def _agree_traced(digest: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """The agreement inside a compiled forward: the same all-gather, checked by an assertion in the graph (no
    host read; on a mismatch every rank fails alike, and an eager forward names the input that differs)."""
    import torch.distributed._functional_collectives as funcol

    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    with comm_kind("agreement"):
        table = funcol.all_gather_tensor(mine, 0, group)
    torch._assert_async(
        (table == mine).all(),
        "sp_diffusers: the ranks of the SP group called the compiled model with different inputs; fix: every "
        "rank of an SP group must run the same model on the same micro-batch (run one forward uncompiled to "
        "see which input differs)",
    )


@torch.compiler.assume_constant_result  # hashlib is not traceable; the signature is made of constants
def _digest(signature: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=8).digest(), "little") >> 1


def _first_difference(rows: list[Any], ranks: list[int]) -> str:
    """The first input whose description differs across the ranks, with each rank's."""
    named = [dict(row) for row in rows]
    for name in dict.fromkeys(n for row in named for n in row):
        values = [row.get(name, "(absent)") for row in named]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {ranks[i]}: {v}" for i, v in enumerate(values))
            return f"{name} ({per_rank})"
    return "the order of their inputs"


def agree_forward(signature: list[tuple[str, str]], group: dist.ProcessGroup, device: torch.device) -> None:
    """The once-per-forward agreement: one all-gather of a digest of ``signature`` (``(name, description)`` of
    the model and of every input, see :func:`describe`); on a mismatch every rank raises the same
    :class:`SPCallMismatch`, naming the first input that differs and every rank's description of it."""
    if torch.compiler.is_compiling():
        _agree_traced(_digest(signature), group, device)
        return
    table = gather_ints([_digest(signature)], group, device)
    if len({row[0] for row in table}) == 1:
        return
    rows: list[Any] = [None] * len(table)
    dist.all_gather_object(rows, signature, group=group)
    raise SPCallMismatch(
        "sp_diffusers: the ranks of the SP group called the model with different inputs: "
        f"{_first_difference(rows, dist.get_process_group_ranks(group))}; fix: every rank of an SP group must run "
        "the same model on the same micro-batch (FSDPEngine broadcasts it; see docs/troubleshooting.md)"
    )


# ------------------------------------------------------------------------------------------ the forward scope

MODES = ("per_forward", "trusted", "per_call")
_MODE_ATTR = "_sp_diffusers_rank_agreement"
_BOOK_SIZE = 4096  # remembered (signature, splits, call) layouts; LRU, the same on every rank
_book: OrderedDict[Hashable, Any] = OrderedDict()
_views: OrderedDict[Hashable, dict | None] = OrderedDict()  # (signature, split record) -> view -> layout
_learned: OrderedDict[Hashable, bool] = OrderedDict()  # signature -> its first forward's layouts all known by view
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
        self._by_split: dict[tuple, set[CallLayout]] = {}  # split record -> its attention calls' layouts
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
        if kind == "attention":
            self._by_split.setdefault(self.split_key, set()).add(layout)

    def learn_views(self) -> bool:
        """At the end of an eager forward: for each split record its attention calls ran under, whether a call's
        own local view names its layout on every rank (then a compiled forward with these inputs finds every
        call's per-rank lengths by its shapes alone, :func:`layout_by_view`). True where every call's does."""
        known = True
        for split_key, layouts in self._by_split.items():
            unique = all(len({lay.view(r) for lay in layouts}) == len(layouts) for r in range(self.world))
            _views[(self.signature, split_key)] = {lay.view(self.rank): lay for lay in layouts} if unique else None
            known = known and unique
        while len(_views) > _BOOK_SIZE:
            _views.popitem(last=False)
        return known

    def compilable(self) -> bool:
        """Whether compiled code may run in this forward (see :func:`compilable`)."""
        return self.mode != "per_call" and bool(_learned.get(self.signature))


def layout_by_view(signature: Hashable, split_key: tuple, view: tuple) -> CallLayout | None:
    """The layout of the uneven forward's call (``signature``, ``split_key``) whose local view is ``view``,
    learned by an eager forward with the same inputs; None where it has not run or a view names two layouts.
    Traced, the lookup's keys become guards: a graph serves only the signature and split record it was made for."""
    views = _views.get((signature, split_key))
    return None if views is None else views.get(view)


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
    # learned once per signature and not touched again: a compiled graph's guards read these tables
    if not torch.compiler.is_compiling() and scope.mode != "per_call" and scope.signature not in _learned:
        _learned[scope.signature] = scope.even or scope.learn_views()
        while len(_learned) > _BOOK_SIZE:
            _learned.popitem(last=False)


def compilable(scope: ForwardScope | None) -> bool:
    """Whether compiled code may run now. A graph cannot ask the SP group anything (a host read), so the first
    forward of each input signature runs eagerly: it learns every call's per-rank lengths (an uneven forward's
    by asking), and the later ones compile where each call's own shapes name its lengths on every rank. Never
    under ``debug_checks``, which checks every call; always outside a model forward. The same on every rank."""
    return scope is None or scope.compilable()


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
