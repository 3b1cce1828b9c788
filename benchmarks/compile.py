"""torch.compile through the Ulysses backend at SP = 2: eager against ``compile_model(model, "blocks")``.

    python benchmarks/compile.py [--tokens 4096] [--repeats 10] [--json out.json]

The narrow Wan of ``benchmarks/_dit.py`` (2 blocks, 4 heads x 32) on 2 ranks, the same weights and inputs for
both variants: a rollout-style forward under ``no_grad`` and a training-style forward+backward, each run
round-robin with the other variant (medians of ``--repeats``), after the compiled model's one-time compile
(reported apart, with the graphs it made). Reports seconds and compiled / eager ratios.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _dit
from benchmarks._harness import add_device_arguments, device, interleaved_times, spawn, write_json


def _parallel(model: torch.nn.Module, compiled: bool) -> torch.nn.Module:
    import sp_diffusers
    from sp_diffusers.engine.compiling import compile_model

    sp_diffusers.install()
    model = copy.deepcopy(model).to(device())
    if compiled:
        compile_model(model, "blocks")  # before the plan's hooks, as FSDPEngine does
    model.set_attention_backend("ulysses_sdpa")
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=2))
    return model


def _run(rank: int, world: int, tokens: int, repeats: int) -> dict:
    from sp_diffusers.engine.compiling import compiled_graphs

    base = _dit.build()
    x = _dit.inputs(tokens, device=device())
    eager, compiled = _parallel(base, False), _parallel(base, True)

    def forward(model: torch.nn.Module):
        def run() -> None:
            with torch.no_grad():
                model(**x, return_dict=False)

        return run

    start = time.perf_counter()
    forward(compiled)()
    _dit.fwd_bwd(compiled, x)
    compile_s = time.perf_counter() - start
    fwd = interleaved_times({"eager": forward(eager), "compiled": forward(compiled)}, repeats)
    train = interleaved_times(
        {"eager": lambda: _dit.fwd_bwd(eager, x), "compiled": lambda: _dit.fwd_bwd(compiled, x)}, repeats
    )
    return {"forward": fwd, "forward_backward": train, "compile_s": compile_s, "graphs": compiled_graphs()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    add_device_arguments(parser)
    args = parser.parse_args()
    r = spawn(_run, 2, args.tokens, args.repeats)[0]
    print(f"narrow Wan, {args.tokens} tokens, SP 2; compile (once): {r['compile_s']:.1f} s, {r['graphs']} graphs")
    for phase in ("forward", "forward_backward"):
        t = r[phase]
        print(
            f"  {phase:17s} eager {t['eager'] * 1e3:8.1f} ms   compiled {t['compiled'] * 1e3:8.1f} ms   "
            f"compiled / eager {t['compiled'] / t['eager']:.3f}"
        )
    write_json(args.json, {"tokens": args.tokens, **r})


if __name__ == "__main__":
    main()
