"""Attention forward+backward: ``ulysses_sdpa`` vs diffusers' ``native`` Ulysses vs one process.

    python benchmarks/attention.py [--seq 2048 4096 8192] [--json out.json] [--plot out.png]
    python benchmarks/attention.py --device cuda --backend nccl --dtype bf16 --world 8 --heads 40 --head-dim 128 \
        --seq 32768 75600      # on a GPU node: NCCL, one GPU per rank

Default: 2 ranks x 1 thread (gloo), fp32, the same inputs everywhere, all variants in one run. With
``--device cuda`` every clock is read after a synchronize, peaks are ``max_memory_allocated``, and each
variant's achieved TFLOP/s (model FLOPs: ``4 B H S^2 D`` forward, twice that backward; a rank does 1/P of
them) and its fraction of the GPU's datasheet peak are reported. Variants (per rank):
  ours       ulysses_sdpa_attention on [B, S/P, H, D] (exchange, local SDPA fwd+bwd, exchange)
  native     diffusers' own native Ulysses (unpatched: no sp_diffusers.install() in this process)
  floor      SDPA fwd+bwd of the local H/P heads over the full S on one process: the compute floor
  single     SDPA fwd+bwd of all H heads over S on one process (what SP replaces)
  exchange   ours: fused Q/K/V all-to-all + output all-to-all, layout copies included (forward only)
  bare       all_to_all_single of the same bytes from ready, contiguous buffers
Times are medians over --repeats, the max over ranks; ratios are taken inside this one run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import (
    achieved,
    add_device_arguments,
    device,
    interleaved_times,
    max_over_ranks,
    peak_bytes,
    spawn,
    write_json,
)

TARGETS = {"ours/native": 0.75, "ours/floor": 1.08, "exchange/bare": 1.3}


def _parallel_config(world: int):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device().type, (1, world), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=world))
    config.setup(dist.get_rank(), world, device(), mesh=mesh)
    return config


def _variants(
    rank: int, world: int, S: int, heads: int, head_dim: int, batch: int, config, dtype: torch.dtype
) -> dict:
    """The benchmarked callables for one sequence length (inputs built once, outside the timing)."""
    from diffusers.models.attention_dispatch import _native_attention

    from sp_diffusers.parallel.attention import ulysses_sdpa_attention
    from sp_diffusers.parallel.exchange import heads_to_seq, seq_to_heads

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(S)
    q, k, v, dout = (
        torch.randn(batch, S, heads, head_dim, generator=g).to(device(), dtype) for _ in range(4)
    )
    s_l, h_l = S // world, heads // world
    sl = slice(rank * s_l, (rank + 1) * s_l)
    local = [t[:, sl].contiguous() for t in (q, k, v, dout)]
    # floor/single get SDPA's own [B, H, S, D] layout, contiguous
    floor = [t[:, :, rank * h_l : (rank + 1) * h_l].transpose(1, 2).contiguous() for t in (q, k, v, dout)]
    single = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]
    # the attention output as SDPA leaves it for seq_to_heads' queries: [B, S, H/P, D] in [S, B, H/P, D] memory
    o_heads = torch.randn(S, batch, h_l, head_dim, generator=g).to(device(), dtype).transpose(0, 1)
    send_qkv = torch.empty(3 * local[0].numel(), device=device(), dtype=dtype)
    send_out = torch.empty(o_heads.numel(), device=device(), dtype=dtype)
    recv_qkv, recv_out = torch.empty_like(send_qkv), torch.empty_like(send_out)

    def sp_fwd_bwd(fn):
        ins = [t.detach().requires_grad_(True) for t in local[:3]]
        fn(*ins, _parallel_config=config).backward(local[3])

    def sdpa_fwd_bwd(tensors):
        ins = [t.detach().requires_grad_(True) for t in tensors[:3]]
        F.scaled_dot_product_attention(*ins).backward(tensors[3])

    def exchange():
        seq_to_heads(local[:3], group)
        heads_to_seq([o_heads], group)

    def bare():
        dist.all_to_all_single(recv_qkv, send_qkv, group=group)
        dist.all_to_all_single(recv_out, send_out, group=group)

    return {
        "ours": lambda: sp_fwd_bwd(ulysses_sdpa_attention),
        "native": lambda: sp_fwd_bwd(_native_attention),
        "floor": lambda: sdpa_fwd_bwd(floor),
        "single": lambda: sdpa_fwd_bwd(single),
        "exchange": exchange,
        "bare": bare,
    }


def bench_rank(
    rank: int,
    world: int,
    seq_lens: list[int],
    heads: int,
    head_dim: int,
    batch: int,
    repeats: int,
    dtype_name: str = "fp32",
):
    import logging

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    config = _parallel_config(world)
    rows = []
    for S in seq_lens:
        variants = _variants(rank, world, S, heads, head_dim, batch, config, dtype)
        # Round-robin: each repetition runs every variant once, so machine noise hits all of them alike.
        samples = interleaved_times(variants, repeats)
        row = {"S": S, "time_s": {n: max_over_ranks(t) for n, t in samples.items()}, "peak_mib": {}}
        for name in ("ours", "native", "floor", "single"):
            row["peak_mib"][name] = max_over_ranks(peak_bytes(variants[name]) / 2**20)
        t = row["time_s"]
        flops = 3 * 4 * batch * heads * S * S * head_dim  # model FLOPs of one fwd+bwd over all heads
        row["tflops_per_rank"] = {
            name: achieved(flops / (1 if name == "single" else world), t[name], dtype)
            for name in ("ours", "native", "floor", "single")
        }
        row["ratios"] = {
            "ours/native": t["ours"] / t["native"],
            "ours/floor": t["ours"] / t["floor"],
            "ours/single": t["ours"] / t["single"],
            "exchange/bare": t["exchange"] / t["bare"],
        }
        rows.append(row)
    return rows


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    seqs = [r["S"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("single", "native", "ours", "floor"):
        ax1.plot(seqs, [r["time_s"][name] * 1e3 for r in rows], marker="o", label=name)
    ax1.set(
        xlabel="sequence length S",
        ylabel="fwd+bwd ms (max over ranks)",
        xscale="log",
        yscale="log",
        title="attention, 2 ranks x 1 thread, fp32",
    )
    ax1.legend()
    for key, target in TARGETS.items():
        line = ax2.plot(seqs, [r["ratios"][key] for r in rows], marker="o", label=key)[0]
        ax2.axhline(target, color=line.get_color(), ls="--", lw=0.8)
    ax2.set(xlabel="sequence length S", ylabel="ratio (dashed: target)", xscale="log", title="ratios")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    rows = spawn(
        bench_rank,
        args.world,
        args.seq,
        args.heads,
        args.head_dim,
        args.batch,
        args.repeats,
        args.dtype,
        backend=args.backend,
        device=args.device,
    )[0]
    print(
        f"\nattention fwd+bwd, {args.world} ranks ({args.backend}, {args.device}), B={args.batch} H={args.heads} "
        f"D={args.head_dim} {args.dtype}"
    )
    print(
        f"{'S':>6} | {'single':>8} {'native':>8} {'ours':>8} {'floor':>8} ms | {'ours/native':>11} "
        f"{'ours/floor':>10} {'xchg/bare':>9} | peak MiB ours/native/single"
    )
    for r in rows:
        t, q, m = r["time_s"], r["ratios"], r["peak_mib"]
        print(
            f"{r['S']:>6} | {t['single'] * 1e3:8.1f} {t['native'] * 1e3:8.1f} {t['ours'] * 1e3:8.1f} "
            f"{t['floor'] * 1e3:8.1f}    | {q['ours/native']:11.3f} {q['ours/floor']:10.3f} {q['exchange/bare']:9.3f} | "
            f"{m['ours']:.1f} / {m['native']:.1f} / {m['single']:.1f}"
        )
    if args.device == "cuda":
        for r in rows:
            rate = r["tflops_per_rank"]
            print(
                f"  S={r['S']}: TFLOP/s per rank (fraction of peak) "
                + ", ".join(
                    f"{n} {v['tflops']:.1f}"
                    + (f" ({v['fraction_of_peak']:.2f})" if v["fraction_of_peak"] else "")
                    for n, v in rate.items()
                )
            )
    print("targets at S=4096: " + ", ".join(f"{k} <= {v}" for k, v in TARGETS.items()))
    write_json(args.json, {"args": vars(args), "targets": TARGETS, "rows": rows})
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
