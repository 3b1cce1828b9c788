"""torch.compile of a transformer under sequence parallelism: its blocks, or its whole forward.

``"blocks"`` compiles the forward of every block of the model's top-level ModuleLists (diffusers' regional
compile, for every family: one graph per block class, reused by every block of that class), ``"model"`` the
model's whole forward. Either way the graphs hold the Ulysses exchange (traced c10d all-to-alls), the ring's
shifts and the plan's splits with no graph break, and the engine's module hooks (FSDP2's gathers, the
per-forward scope) stay outside them, run once per forward as in eager. The first forward of each input
signature runs eagerly (``sp_diffusers.parallel.agreement.compilable``). What a compile costs and gains:
docs/benchmarks.md, "Compiling".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..parallel.agreement import compilable, current

__all__ = ["COMPILE_MODES", "blocks_of", "compile_model", "compiled_graphs"]

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
    engine pads text to :func:`sp_diffusers.parallel.padding.length_bucket` lengths, one graph each."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r} is not one of {COMPILE_MODES}")
    if mode == "off" or getattr(model, _MARK, "off") != "off":
        return
    targets = list(blocks_of(model)) if mode == "blocks" else [model]
    if not targets:
        raise ValueError(
            f"compile='blocks': {type(model).__name__} has no ModuleList of blocks; fix: compile='model'"
        )
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
