"""Strong scaling of a tiny video DiT (WanTransformer3DModel, 2 layers) forward+backward under Ulysses SP.

    python benchmarks/scaling.py [--tokens 2048 4096 8192] [--repeats 3] [--json out.json] [--plot out.png]

2 ranks x 1 thread each, in one run, round-robin per repetition: ``P=1`` = each rank runs the whole model
alone at the same time (so the baseline sees the same load on the 2 cores), ``P=2`` = Ulysses SP over
both. Efficiency ``E = T1 / (P * T_P)``. (P = 4 would oversubscribe this 2-core machine: 4 processes
time-slice 2 cores, so it is not reported as scaling.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _dit
from benchmarks._harness import (
    achieved,
    add_device_arguments,
    count_flops,
    device,
    interleaved_times,
    max_over_ranks,
    spawn,
    write_json,
)


def scaling_rank(rank: int, world: int, tokens: list[int], repeats: int) -> list[dict]:
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    model = _dit.build().to(device())
    sp = _dit.sp_copy(model, world)
    rows = []
    for s in tokens:
        x = _dit.inputs(s, device=device())
        times = interleaved_times(
            {"P1": lambda x=x: _dit.fwd_bwd(model, x), f"P{world}": lambda x=x: _dit.fwd_bwd(sp, x)}, repeats
        )
        t1, tp = max_over_ranks(times["P1"]), max_over_ranks(times[f"P{world}"])
        flops = count_flops(lambda x=x: _dit.fwd_bwd(model, x))  # the whole model's; a rank of P does 1/P
        rows.append(
            {
                "tokens": s,
                "T1": t1,
                "TP": tp,
                "P": world,
                "efficiency": t1 / (world * tp),
                "tflops_per_rank": {
                    "P1": achieved(flops, t1, torch.float32),
                    "PP": achieved(flops / world, tp, torch.float32),
                },
                "max_memory_allocated": torch.cuda.max_memory_allocated()
                if device().type == "cuda"
                else None,
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    rows = spawn(scaling_rank, 2, args.tokens, args.repeats, backend=args.backend, device=args.device)[0]
    print(
        f"\nWan-shaped DiT ({_dit.LAYERS} layers, {_dit.HEADS}x{_dit.HEAD_DIM} heads, FFN {_dit.FFN}), fwd+bwd, fp32"
    )
    prev = None
    for r in rows:
        growth = f"  T1 x{r['T1'] / prev['T1']:.2f} for S x{r['tokens'] / prev['tokens']:.0f}" if prev else ""
        rate = r["tflops_per_rank"]
        print(
            f"  S={r['tokens']:6d}  T1 {r['T1']:.3f}s  T2 {r['TP']:.3f}s  efficiency {r['efficiency']:.3f}{growth}"
            f"  TFLOP/s per rank P1 {rate['P1']['tflops']:.3g} P2 {rate['PP']['tflops']:.3g}"
        )
        prev = r
    print("target: efficiency >= 0.93 at S >= 8192, P = 2")
    write_json(args.json, {"args": vars(args), "rows": rows})
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ax.plot([r["tokens"] for r in rows], [r["efficiency"] for r in rows], marker="o", label="P = 2")
        ax.axhline(0.93, ls="--", color="gray", lw=0.8, label="target 0.93")
        ax.set(
            xscale="log", xlabel="tokens S", ylabel="E = T1 / (P T_P)", title="strong scaling, Ulysses P = 2"
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
