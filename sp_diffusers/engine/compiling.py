"""torch.compile of a transformer under sequence parallelism: its blocks, or its whole forward.

``"blocks"`` compiles the forward of every block of the model's top-level ModuleLists (diffusers' regional
compile, for every family: one graph per block class, reused by every block of that class), ``"model"`` the
model's whole forward. Either way the graphs hold the Ulysses exchange (traced c10d all-to-alls), the ring's
shifts and the plan's splits with no graph break, and the engine's module hooks (FSDP2's gathers, the
per-forward scope) stay outside them, run once per forward as in eager. The first forward of each input
signature runs eagerly (``sp_diffusers.parallel.agreement.compilable``). What a compile costs and gains:
docs/benchmarks.md, "Compiling".

The communication ledger (``sp_diffusers.parallel.ledger``) cannot see a collective inside a graph: the compiled
code calls the c10d functional ops, not the Python functions the ledger wraps. So the ``"inductor"`` backend is
run through :func:`counting_backend`: inductor's ``compile_fx`` with an inner compile that lists each forward and
backward graph's collectives after AOT autograd (kind and bytes by the ledger's own rules, from the graph's static
shapes: :func:`~sp_diffusers.parallel.ledger.graph_collectives`) and makes the compiled code add them to the
recording ledger on every run, under the phase and kind open then (a backward graph: when autograd runs it). No
tensor is read. What is counted is what the graph issues, which may differ from eager where the compiler merges
identical collectives (docs/benchmarks.md, "Compiling"). AOT autograd's cache is off for these compiles: a hit
would skip the inner compile, and its count with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..parallel.agreement import compilable, current
from ..parallel.ledger import count_graph, graph_collectives

__all__ = ["COMPILE_MODES", "blocks_of", "compile_model", "compiled_graphs", "counting_backend"]

COMPILE_MODES = ("off", "blocks", "model")
_MARK = "_sp_diffusers_compiled"

logger = logging.getLogger(__name__)


def blocks_of(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The repeated blocks: every module of the model's top-level ModuleLists (what FSDP2 shards one by one)."""
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            yield from child


def compile_model(
    model: torch.nn.Module, mode: str, fullgraph: bool = True, backend: Any = "inductor"
) -> None:
    """Compile ``model`` in place (``mode`` one of :data:`COMPILE_MODES`; ``"off"`` does nothing). Only the
    ``forward`` of each compiled module is replaced, so module hooks run eagerly around the graph: compile
    before ``enable_parallelism`` and sharding, whose hooks then wrap the compiled forwards. ``fullgraph``: a
    graph break is an error (every family the trainer trains compiles without one). Shapes are static: the
    engine pads text to :func:`sp_diffusers.parallel.padding.length_bucket` lengths, one graph each.
    ``backend="inductor"`` counts the graphs' collectives in the ledger (:func:`counting_backend`); another
    backend compiles as given, its collectives unseen by the ledger."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r} is not one of {COMPILE_MODES}")
    if mode == "off" or getattr(model, _MARK, "off") != "off":
        return
    targets = list(blocks_of(model)) if mode == "blocks" else [model]
    if not targets:
        raise ValueError(
            f"compile='blocks': {type(model).__name__} has no ModuleList of blocks; fix: compile='model'"
        )
    if backend == "inductor":
        backend = counting_backend()
    for module in targets:
        compiled = torch.compile(module.forward, fullgraph=fullgraph, dynamic=False, backend=backend)
        module.forward = _when_compilable(module.forward, compiled)
    setattr(model, _MARK, mode)
    logger.info("compiled %s: %s (%d modules)", type(model).__name__, mode, len(targets))


def _when_compilable(eager: Callable, compiled: Callable) -> Callable:
    """``compiled``, except in a forward a graph cannot run yet: the first with its input signature, which learns
    its calls' per-rank lengths, and ``debug_checks`` (``sp_diffusers.parallel.agreement.compilable``)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not compilable(current()):
            return eager(*args, **kwargs)
        # the plan's split hands the first block views of the whole sequence: made dense, every block of a
        # class takes tensors of one layout, so all share one graph
        args = tuple(_dense(a) for a in args)
        return compiled(*args, **{k: _dense(v) for k, v in kwargs.items()})

    return forward


def _dense(x: Any) -> Any:
    """``x`` with the strides of a fresh tensor of its shape (a split's view of a batch of one is contiguous
    by ``is_contiguous`` yet strides its batch dim by the whole sequence: dynamo guards on every stride)."""
    if not isinstance(x, torch.Tensor):
        return x
    strides, step = [], 1
    for n in reversed(x.shape):
        strides.append(step)
        step *= max(n, 1)
    return x if x.stride() == tuple(reversed(strides)) else x.clone(memory_format=torch.contiguous_format)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (every compilation and recompilation counts)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def counting_backend(inner_compile: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A ``torch.compile`` backend: inductor's ``compile_fx`` whose forward and backward graphs (after AOT
    autograd) add their collectives to the recording ledger each time they run. ``inner_compile``: what
    compiles each graph (default inductor's ``compile_fx_inner``; a test may run the graph as it is); it is
    called as ``compile_fx_inner`` is and returns a boxed callable (``OutputCode`` or ``make_boxed_func``'s)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    inner = inner_compile or compile_fx_inner

    def counted_inner(gm: torch.fx.GraphModule, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        entries = graph_collectives(gm)  # before inductor lowers the graph (its fake values are still there)
        code = inner(gm, example_inputs, *args, **kwargs)
        return _counting(code, entries) if entries else code

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # a cache hit of AOT autograd would return compiled graphs without calling the inner compile
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=counted_inner)

    return backend


_COUNTING_TYPES: dict[type, type] = {}


def _counting(code: Any, entries: list[tuple[str, int]]) -> Any:
    """``code`` (a boxed compiled graph: called with one list of inputs) that first adds ``entries`` to the
    recording ledger. An ``OutputCode`` keeps its type for AOT autograd's runtime (which reads its attributes):
    its class becomes a subclass whose ``__call__`` counts; a plain function is wrapped."""
    from torch._inductor.output_code import OutputCode

    if not isinstance(code, OutputCode):

        def boxed(inputs: list[Any]) -> Any:
            count_graph(entries)
            return code(inputs)

        boxed._boxed_call = True  # type: ignore[attr-defined]
        return boxed
    cls = type(code)
    if cls not in _COUNTING_TYPES:

        def __call__(self: Any, inputs: list[Any]) -> Any:  # the boxed call of AOT's runtime
            count_graph(self._sp_ledger_entries)
            return cls.__call__(self, inputs)

        _COUNTING_TYPES[cls] = type(f"Counting{cls.__name__}", (cls,), {"__call__": __call__})
    code.__class__ = _COUNTING_TYPES[cls]
    code._sp_ledger_entries = entries
    return code
