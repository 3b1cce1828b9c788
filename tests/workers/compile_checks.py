"""torch.compile through the Ulysses backend, checked on one 4-rank process group (``tests/test_compile.py``).

Per case (a tiny model of a family the trainer trains, a layout): one eager SP forward+backward, then the same
model compiled by ``sp_diffusers.engine.compiling.compile_model(model, "blocks")`` (fullgraph: a graph break
fails the case) with a backend that keeps every forward and backward graph it is handed (AOT autograd with
inductor's partitioner, run eagerly), run twice. Reported: the largest output and gradient differences against eager with their tolerances,
the collectives and host syncs in the graphs, and the graphs compiled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .model_cases import build, outputs, sp_inputs

_SDPA = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention")
_SYNCS = ("_local_scalar_dense", "item", "nonzero", "equal", "masked_select")


def _ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts = {"all_to_all": 0, "collective": 0, "sdpa": 0, "sdpa_backward": 0, "sync": 0}
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "call_function":
            continue
        if "_c10d_functional" in name and "wait_tensor" not in name:
            counts["collective"] += 1
            counts["all_to_all"] += "all_to_all" in name
        if any(f".{op}" in name for op in _SDPA):
            counts["sdpa_backward" if "backward" in name else "sdpa"] += 1
        if any(f"aten.{op}." in name for op in _SYNCS):
            counts["sync"] += 1
    return counts


def _recording_backend(graphs: dict[str, list[dict[str, int]]]):
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, _inputs: Any):
            graphs[kind].append(_ops(gm))
            return make_boxed_func(gm.forward)

        return compiler

    # inductor's partitioner: what the backward graph recomputes is what a compiled run recomputes
    return aot_autograd(
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )


def _run(
    model: torch.nn.Module, inputs: dict[str, Any]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    outs = outputs(model(**inputs, return_dict=False))
    sum(o.float().square().mean() for o in outs).backward()
    return [o.detach() for o in outs], {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _worst(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (1e-5 + 1e-4 |ref|): <= 1 is within the parity tolerance (tests/_parity.py)."""
    return ((got - ref).abs() / (1e-5 + 1e-4 * ref.abs())).max().item()


def compile_checks(rank: int, world: int, cases: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """``cases``: ``(model case, length, ulysses, ring)``; results by ``"<case>/<length>/u<U>r<R>"``."""
    import sp_diffusers
    from sp_diffusers.engine.compiling import compile_model, compiled_graphs

    torch.manual_seed(0)
    sp_diffusers.install()
    results: dict[str, Any] = {}
    meshes: dict[tuple[int, int], Any] = {}
    for name, length, ulysses, ring in cases:
        case = f"{name}/{length}/u{ulysses}r{ring}"
        if (ulysses, ring) not in meshes:
            meshes[ulysses, ring] = sp_diffusers.build_device_mesh(ulysses_degree=ulysses, ring_degree=ring)
        try:
            models = []
            for compiled in (False, True):
                model, inputs = build(name, length, seed=0)
                graphs: dict[str, list[dict[str, int]]] = {"forward": [], "backward": []}
                if compiled:
                    compile_model(model, "blocks", backend=_recording_backend(graphs))
                model.set_attention_backend("ulysses_sdpa")
                config = sp_diffusers.context_parallel_config(
                    ulysses_degree=ulysses, ring_degree=ring, mesh=meshes[ulysses, ring]
                )
                model.enable_parallelism(config=config)
                models.append((model, sp_inputs(name, length, inputs, ulysses * ring), graphs))
            (eager, inputs, _), (model, _, graphs) = models
            ref_out, ref_grads = _run(eager, inputs)
            before = compiled_graphs()
            # the first forward of these inputs runs eagerly and learns its calls' layouts; the second
            # compiles, the third reuses the graphs
            for _ in range(3):
                out, grads = _run(model, inputs)
            results[case] = {
                "out": max(_worst(o, r) for o, r in zip(out, ref_out, strict=True)),
                "grad": max(_worst(grads[n], g) for n, g in ref_grads.items() if n in grads),
                # a parameter that does not reach the loss: eager's backward may give it zeros, a graph None
                "missing_nonzero": sorted(n for n, g in ref_grads.items() if n not in grads and g.any()),
                "graphs": graphs,
                "compiled": compiled_graphs() - before,
            }
        except Exception as err:  # reported per case; every rank runs the same cases
            results[case] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        dist.barrier()
    return results


def compiled_training(rank: int, world: int, out_dir: str, iterations: int) -> dict[str, Any]:
    """The tiny Qwen-Image job at SP 2 with ``train.compile: blocks``, ragged prompts, an uneven image (9 tokens)
    and classifier-free guidance (one batched forward): every iteration's metrics."""
    from sp_diffusers.flowgrpo.config import load_config
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    config = load_config("examples/configs/tiny_qwenimage_sp2.yaml")
    config.model.image_size, config.flowgrpo.cfg_scale = 6, 4.5
    config.train.compile, config.train.out_dir, config.train.iterations = "blocks", out_dir, iterations
    config.train.progress, config.train.plot, config.train.save_every = False, False, 0
    config.train.loggers = ["jsonl"]
    torch.manual_seed(1234)
    return {"history": FlowGRPOTrainer(config).run()}


def regional_compile(rank: int, world: int, cases: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """diffusers' own regional compile, as a diffusers user calls it: ``enable_parallelism`` on the ulysses_sdpa
    backend, then ``model.compile_repeated_blocks(fullgraph=True)`` (no sp-diffusers wrapper). Per case the worst
    output / gradient difference against eager SP (over the tolerance: > 1) and the graphs compiled."""
    import sp_diffusers
    from sp_diffusers.engine.compiling import compiled_graphs

    torch.manual_seed(0)
    sp_diffusers.install()
    results: dict[str, Any] = {}
    for name, length, ulysses, ring in cases:
        case = f"{name}/{length}/u{ulysses}r{ring}"
        mesh = sp_diffusers.build_device_mesh(ulysses_degree=ulysses, ring_degree=ring)
        try:
            runs = []
            for compiled in (False, True):
                model, inputs = build(name, length, seed=0)
                model.set_attention_backend("ulysses_sdpa")
                config = sp_diffusers.context_parallel_config(ulysses_degree=ulysses, ring_degree=ring, mesh=mesh)
                model.enable_parallelism(config=config)
                graphs: dict[str, list[dict[str, int]]] = {"forward": [], "backward": []}
                sharded = sp_inputs(name, length, inputs, ulysses * ring)
                if compiled:
                    if length == "uneven":  # the documented fix: one forward of these shapes before compiling
                        _run(model, sharded)
                    model.compile_repeated_blocks(fullgraph=True, dynamic=False, backend=_recording_backend(graphs))
                runs.append((model, sharded, graphs))
            (eager, inputs, _), (model, _, graphs) = runs
            ref_out, ref_grads = _run(eager, inputs)
            before = compiled_graphs()
            for _ in range(2):
                out, grads = _run(model, inputs)
            results[case] = {
                "out": max(_worst(o, r) for o, r in zip(out, ref_out, strict=True)),
                "grad": max(_worst(grads[n], g) for n, g in ref_grads.items() if n in grads),
                "graphs": graphs,
                "compiled": compiled_graphs() - before,
            }
        except Exception as err:
            results[case] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        dist.barrier()
    return results
