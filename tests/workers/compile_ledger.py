"""The communication ledger under ``compile_model(model, "blocks")``, on one 4-rank process group
(``tests/test_compile_ledger.py``).

Per case (a tiny model, an uneven length, a layout, the compiler): the same model eager and compiled run the
trainer's sequence - a no-grad forward under ``"rollout"``, a forward under ``"train_forward"``, its backward
under ``"train_backward"`` - once unrecorded (the compiled model's first forward of each signature runs eagerly
and compiles the next), then once recorded by a :class:`~sp_diffusers.parallel.ledger.CommLedger`. Reported:
both ledgers, how many compiled-graph runs counted collectives in the recorded pass, and the graphs compiled.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from .model_cases import build, outputs, sp_inputs


def _pass(model: torch.nn.Module, inputs: dict[str, Any], ledger: Any) -> None:
    """The trainer's phases: a rollout forward (no grad), a training forward and its backward."""
    from sp_diffusers.parallel.ledger import comm_phase

    with ledger.recording() if ledger is not None else nullcontext():
        with torch.no_grad(), comm_phase("rollout"):
            model(**inputs, return_dict=False)
        with comm_phase("train_forward"):
            outs = outputs(model(**inputs, return_dict=False))
        with comm_phase("train_backward"):
            sum(o.float().square().mean() for o in outs).backward()


def _as_graph(gm: torch.fx.GraphModule, _inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """An inner compile that runs the graph as it is (ATen ops, no inductor): cheap on a 2-core host."""
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def compile_ledger(rank: int, world: int, cases: list[tuple[str, str, int, int, str]]) -> dict[str, Any]:
    """``cases``: ``(model case, length, ulysses, ring, inner)`` with inner ``"inductor"`` (``compile_model``'s
    default backend) or ``"graph"`` (the counting backend, graphs run as they are); results by
    ``"<case>/<length>/u<U>r<R>/<inner>"``."""
    import sp_diffusers
    from sp_diffusers.engine import compiling
    from sp_diffusers.parallel.ledger import CommLedger

    torch.manual_seed(0)
    sp_diffusers.install()
    runs = [0]
    count_graph = compiling.count_graph

    def spy(entries: list[tuple[str, int]]) -> None:  # counts the compiled graphs' runs that add entries
        runs[0] += 1
        count_graph(entries)

    compiling.count_graph = spy
    results: dict[str, Any] = {}
    meshes: dict[tuple[int, int], Any] = {}
    for name, length, ulysses, ring, inner in cases:
        case = f"{name}/{length}/u{ulysses}r{ring}/{inner}"
        if (ulysses, ring) not in meshes:
            meshes[ulysses, ring] = sp_diffusers.build_device_mesh(ulysses_degree=ulysses, ring_degree=ring)
        try:
            result: dict[str, Any] = {}
            for compiled in (False, True):
                model, inputs = build(name, length, seed=0)
                if compiled:
                    backend = "inductor" if inner == "inductor" else compiling.counting_backend(_as_graph)
                    compiling.compile_model(model, "blocks", backend=backend)
                model.set_attention_backend("ulysses_sdpa")
                config = sp_diffusers.context_parallel_config(
                    ulysses_degree=ulysses, ring_degree=ring, mesh=meshes[ulysses, ring]
                )
                model.enable_parallelism(config=config)
                inputs = sp_inputs(name, length, inputs, ulysses * ring)
                before = compiling.compiled_graphs()
                _pass(model, inputs, None)  # compiled: the first forwards run eagerly and learn the layouts
                _pass(model, inputs, None)  # compiled: compiles
                runs[0] = 0
                ledger = CommLedger()
                _pass(model, inputs, ledger)
                label = "compiled" if compiled else "eager"
                result[label] = {f"{p}/{k}": list(v) for (p, k), v in sorted(ledger.take().items())}
                if compiled:
                    result["graph_runs"] = runs[0]
                    result["graphs"] = compiling.compiled_graphs() - before
            results[case] = result
        except Exception as err:  # reported per case; every rank runs the same cases
            import traceback

            results[case] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"[-4000:]}
        dist.barrier()
    compiling.count_graph = count_graph
    return results
