"""Per-rank peak memory of a tiny video DiT forward+backward at P = 1 and 2, and the largest S in a budget.

    python benchmarks/memory.py [--tokens 1024 2048 4096 8192] [--budget-mib 256] [--json out.json]

Peak = bytes allocated above what was live before the step (CPU, profiler-traced; see _harness.py), max
over ranks. The largest S within the budget is found by doubling, then bisecting, S over multiples of
the frame size, measuring each candidate (not extrapolated).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _dit
from benchmarks._harness import add_device_arguments, device, max_over_ranks, peak_bytes, spawn, write_json

FRAME = 256  # tokens per frame of the 32x32 latent


def _peak(model, s: int) -> float:
    x = _dit.inputs(s, device=device())
    _dit.fwd_bwd(model, x)  # warm caches/buffers out of the measurement
    return max_over_ranks(peak_bytes(lambda: _dit.fwd_bwd(model, x)) / 2**20)  # GPU: max_memory_allocated


def _largest(model, budget: float, start: int, limit: int) -> int:
    lo, hi = 0, start
    while hi <= limit and _peak(model, hi) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + FRAME)
    while hi - lo > FRAME:
        mid = (lo + hi) // 2 // FRAME * FRAME
        if mid <= lo:
            break
        if _peak(model, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def memory_rank(rank: int, world: int, tokens: list[int], budget: float, limit: int) -> dict:
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    model = _dit.build().to(device())
    sp = _dit.sp_copy(model, world)
    rows = [{"tokens": s, "P1_mib": _peak(model, s), "P2_mib": _peak(sp, s)} for s in tokens]
    for r in rows:
        r["ratio"] = r["P2_mib"] / r["P1_mib"]
    largest = {"P1": _largest(model, budget, FRAME * 4, limit), "P2": _largest(sp, budget, FRAME * 4, limit)}
    return {"rows": rows, "largest_tokens_in_budget": largest, "budget_mib": budget}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--budget-mib", type=float, default=256.0)
    p.add_argument("--limit", type=int, default=32768, help="largest S tried in the budget search")
    p.add_argument("--json", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    out = spawn(
        memory_rank, 2, args.tokens, args.budget_mib, args.limit, backend=args.backend, device=args.device
    )[0]
    print("\nper-rank peak MiB, fwd+bwd, Wan-shaped DiT, fp32")
    for r in out["rows"]:
        print(f"  S={r['tokens']:6d}  P=1 {r['P1_mib']:8.1f}  P=2 {r['P2_mib']:8.1f}  ratio {r['ratio']:.3f}")
    largest = out["largest_tokens_in_budget"]
    print(
        f"largest S within {args.budget_mib:.0f} MiB per rank: P=1 {largest['P1']}, P=2 {largest['P2']} "
        f"({largest['P2'] / max(1, largest['P1']):.2f}x)"
    )
    print("target: P=2 / P=1 <= 0.60 at the largest S measured")
    write_json(args.json, {"args": vars(args), **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
