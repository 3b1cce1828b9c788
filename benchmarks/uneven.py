"""What any-length support costs: ``ulysses_sdpa`` at an even S, at S - 1 (uneven shards), and the code before
any-length support at the same even S, forward + backward, in one interleaved run.

    git worktree add /tmp/sp-before 89b0014      # sp-diffusers before the uneven-length work
    python benchmarks/uneven.py --before-tree /tmp/sp-before [--seq 4096] [--repeats 9] [--json out.json]

Variants (2 ranks x 1 thread, gloo, fp32, B = 1, H = 8, D = 64 as benchmarks/attention.py):
  even     ulysses_sdpa at S (every rank S/P tokens; the handshake, split sizes None)
  uneven   ulysses_sdpa at S - 1 (ranks hold S/P and S/P - 1: split sizes carried by the all-to-alls)
  before   the earlier tree's ulysses_sdpa at S (no handshake): the reference for "the even path keeps its speed"
Targets: even/before <= 1.03; uneven/even <= 1.05 (an uneven S against the even path at the next multiple).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import (
    achieved,
    add_device_arguments,
    device,
    interleaved_times,
    max_over_ranks,
    spawn,
    write_json,
)

TARGETS = {"even/before": 1.03, "uneven/even": 1.05}


def _load_tree(tree: str):
    """The ``sp_diffusers`` package of another checkout, imported as ``sp_before`` (no clash with ours)."""
    root = os.path.join(tree, "sp_diffusers")
    spec = importlib.util.spec_from_file_location(
        "sp_before", os.path.join(root, "__init__.py"), submodule_search_locations=[root]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["sp_before"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("sp_before.attention")


def bench_rank(
    rank: int, world: int, seq_lens: list[int], repeats: int, before_tree: str | None
) -> list[dict]:
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from sp_diffusers.parallel.attention import ulysses_sdpa_attention

    mesh = init_device_mesh(device().type, (1, world), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=world))
    config.setup(rank, world, device(), mesh=mesh)
    before = _load_tree(before_tree).ulysses_sdpa_attention if before_tree else None
    rows = []
    for S in seq_lens:
        g = torch.Generator().manual_seed(S)
        full = [torch.randn(1, S, 8, 64, generator=g).to(device()) for _ in range(4)]

        def local(length: int, full=full) -> list[torch.Tensor]:
            return [t[:, :length].tensor_split(world, dim=1)[rank].contiguous() for t in full]

        even, uneven = local(S), local(S - 1)

        def run(fn, tensors):
            ins = [t.detach().requires_grad_(True) for t in tensors[:3]]
            fn(*ins, _parallel_config=config).backward(tensors[3])

        variants = {
            "even": lambda even=even: run(ulysses_sdpa_attention, even),
            "uneven": lambda uneven=uneven: run(ulysses_sdpa_attention, uneven),
        }
        if before is not None:
            variants["before"] = lambda even=even: run(before, even)
        t = {n: max_over_ranks(x) for n, x in interleaved_times(variants, repeats).items()}
        ratios = {"uneven/even": t["uneven"] / t["even"]}
        if before is not None:
            ratios["even/before"] = t["even"] / t["before"]
        flops = 3 * 4 * 8 * S * S * 64 / world  # model FLOPs of one fwd+bwd, this rank's share
        rate = {n: achieved(flops, v, torch.float32) for n, v in t.items()}
        rows.append({"S": S, "time_s": t, "ratios": ratios, "tflops_per_rank": rate})
        dist.barrier()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--before-tree", default=None, help="a checkout of an earlier sp-diffusers (its sp_diffusers/)"
    )
    p.add_argument("--json", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    rows = spawn(
        bench_rank,
        args.world,
        args.seq,
        args.repeats,
        args.before_tree,
        backend=args.backend,
        device=args.device,
    )[0]
    print(
        f"\nulysses_sdpa fwd+bwd, {args.world} ranks x 1 thread, B=1 H=8 D=64 fp32, median of {args.repeats}"
    )
    for r in rows:
        times = ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in r["time_s"].items())
        ratios = ", ".join(f"{n} {v:.3f}" for n, v in r["ratios"].items())
        print(f"S={r['S']}: {times} | {ratios}")
    print("targets: " + ", ".join(f"{k} <= {v}" for k, v in TARGETS.items()))
    write_json(args.json, {"args": vars(args), "targets": TARGETS, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
