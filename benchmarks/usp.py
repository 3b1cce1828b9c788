"""Ulysses x Ring on 4 ranks: attention time, bytes and peak memory for (U, R) = (4, 1), (2, 2), (1, 4).

    python benchmarks/usp.py [--seq 4096 8192] [--heads 8] [--json out.json] [--plot out.png]

4 ranks x 1 thread (gloo), fp32, B=1, one attention layer forward+backward through ``ulysses_sdpa`` on
a (dp=1, ring=R, ulysses=U) mesh, inputs ``[B, S/4, H, D]`` per rank. Per layout:
  time       median fwd+bwd seconds (max over ranks), layouts interleaved so machine noise hits all alike
  bytes      bytes that leave the rank per layer, forward and backward, counted by intercepting every
             collective and point-to-point send (benchmarks/comm.py's counter)
  peak       peak bytes allocated during fwd+bwd above the inputs (profiler), max over ranks
  kept       bytes a forward leaves alive for its backward (saved activations + output): per layer, so
             in a model with L layers this is what L times accumulates
With a ring, "allgather" is the same layout with K/V all-gathered over the ring instead of streamed
(the form the backend uses when dropout needs one softmax over all keys): it shows what streaming
buys in memory and costs in time. On a 2-core machine the 4 ranks share cores: compare ratios only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import (
    achieved,
    add_device_arguments,
    device,
    interleaved_times,
    max_over_ranks,
    memory_profile,
    spawn,
    write_json,
)
from benchmarks.comm import _Counter, counting

LAYOUTS = ((4, 1), (2, 2), (1, 4))  # (ulysses, ring)


def _allgather_ring(
    query, key, value, group, attn_mask=None, is_causal=False, scale=None, kv_sizes=None, q_start=None
):
    """Drop-in for ``ring_attention`` that all-gathers K/V over the ring (``[B, H, S/R, D]`` layout)."""
    from sp_diffusers.parallel.gathers import gather_seq

    k, v = gather_seq([key.transpose(1, 2), value.transpose(1, 2)], group, kv_sizes)
    return F.scaled_dot_product_attention(query, k.transpose(1, 2), v.transpose(1, 2), scale=scale)


def bench_rank(rank: int, world: int, seqs: list[int], heads: int, head_dim: int, repeats: int) -> list[dict]:
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    import sp_diffusers

    configs = {}
    for u, r in LAYOUTS:
        mesh = sp_diffusers.build_device_mesh(ulysses_degree=u, ring_degree=r)
        config = ParallelConfig(
            context_parallel_config=ContextParallelConfig(ulysses_degree=u, ring_degree=r)
        )
        config.setup(rank, world, device(), mesh=mesh)
        configs[(u, r)] = config

    rows = []
    for S in seqs:
        rows += _bench_seq(rank, world, S, heads, head_dim, repeats, configs)
    return rows


def _bench_seq(
    rank: int, world: int, S: int, heads: int, head_dim: int, repeats: int, configs: dict
) -> list[dict]:
    from sp_diffusers.parallel import attention

    g = torch.Generator().manual_seed(S)
    full = [torch.randn(1, S, heads, head_dim, generator=g).to(device()) for _ in range(4)]
    s_l = S // world
    q, k, v, dout = (t[:, rank * s_l : (rank + 1) * s_l].contiguous() for t in full)
    inputs = [t.requires_grad_(True) for t in (q, k, v)]

    def forward(layout: tuple[int, int], allgather: bool) -> torch.Tensor:
        for t in inputs:
            t.grad = None
        if not allgather:
            return attention.ulysses_sdpa_attention(*inputs, _parallel_config=configs[layout])
        with mock.patch.object(attention, "ring_attention", _allgather_ring):
            return attention.ulysses_sdpa_attention(*inputs, _parallel_config=configs[layout])

    def backward(out: torch.Tensor, allgather: bool) -> None:
        if not allgather:
            out.backward(dout)
            return
        with mock.patch.object(attention, "ring_attention", _allgather_ring):
            out.backward(dout)

    variants: dict[str, tuple[tuple[int, int], bool]] = {}
    for u, r in LAYOUTS:
        variants[f"U{u}xR{r}"] = ((u, r), False)
        if r > 1:
            variants[f"U{u}xR{r} allgather"] = ((u, r), True)
    steps = {name: functools.partial(_fwd_bwd, forward, backward, *spec) for name, spec in variants.items()}
    times = interleaved_times(steps, repeats=repeats, warmup=1)
    rows, outputs = [], []
    for name, (layout, allgather) in variants.items():
        fwd, bwd = _Counter(world), _Counter(world)
        with counting(fwd):
            out = forward(layout, allgather)
        with counting(bwd):
            backward(out, allgather)
        # what one layer keeps alive between its forward and backward: in a model, L layers keep L of it
        _, kept = memory_profile(
            lambda layout=layout, allgather=allgather: outputs.append(forward(layout, allgather))
        )
        backward(outputs.pop(), allgather)
        peak, _ = memory_profile(steps[name])
        seconds = max_over_ranks(times[name])
        flops = 3 * 4 * heads * S * S * head_dim / world  # model FLOPs of one fwd+bwd, this rank's share
        rows.append(
            {
                "S": S,
                "variant": name,
                "tflops_per_rank": achieved(flops, seconds, torch.float32),
                "seconds": seconds,
                "fwd_bytes": int(max_over_ranks(fwd.bytes)),
                "bwd_bytes": int(max_over_ranks(bwd.bytes)),
                "fwd_calls": fwd.calls,
                "bwd_calls": bwd.calls,
                "peak_bytes": int(max_over_ranks(peak)),
                "kept_bytes": int(max_over_ranks(kept)),
            }
        )
    return rows


def _fwd_bwd(forward, backward, layout: tuple[int, int], allgather: bool) -> None:
    backward(forward(layout, allgather), allgather)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["S"] for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    width = 0.8 / len(names)
    panels = (
        ("fwd+bwd ms (max over ranks)", lambda r: r["seconds"] * 1e3),
        ("MiB sent per rank (fwd+bwd)", lambda r: (r["fwd_bytes"] + r["bwd_bytes"]) / 2**20),
        ("peak MiB per rank (one layer fwd+bwd)", lambda r: r["peak_bytes"] / 2**20),
        ("MiB kept fwd->bwd per layer (x L layers)", lambda r: r["kept_bytes"] / 2**20),
    )
    for i, name in enumerate(names):
        sel = [next(r for r in rows if r["S"] == s and r["variant"] == name) for s in seqs]
        xs = [j + i * width for j in range(len(seqs))]
        for ax, (_, value) in zip(axes, panels, strict=True):
            ax.bar(xs, [value(r) for r in sel], width, label=name)
    for ax, (title, _) in zip(axes, panels, strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [f"S={s}" for s in seqs])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.suptitle("Ulysses x Ring on 4 gloo ranks (fp32, 1 thread each)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--replot", default=None, help="only redraw --plot from this --json file")
    add_device_arguments(p)
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            _plot(json.load(f)["rows"], args.plot or "usp.png")
        return 0
    for s in args.seq:
        if s % 4:
            p.error(f"--seq {s}: must be divisible by the 4 ranks (e.g. {s - s % 4 + 4})")
    if args.heads % 4:
        p.error(f"--heads {args.heads}: Ulysses degree 4 needs heads divisible by 4 (e.g. 8)")
    rows = spawn(
        bench_rank,
        4,
        args.seq,
        args.heads,
        args.head_dim,
        args.repeats,
        backend=args.backend,
        device=args.device,
    )[0]
    print(f"4 ranks x 1 thread, H={args.heads} D={args.head_dim} B=1 fp32; ratios vs U4xR1 at the same S")
    for S in args.seq:
        base = next(r for r in rows if r["S"] == S and r["variant"] == "U4xR1")
        for r in (r for r in rows if r["S"] == S):
            r["time_vs_ulysses"] = r["seconds"] / base["seconds"]
            r["bytes_vs_ulysses"] = (r["fwd_bytes"] + r["bwd_bytes"]) / (
                base["fwd_bytes"] + base["bwd_bytes"]
            )
            r["peak_vs_ulysses"] = r["peak_bytes"] / base["peak_bytes"]
            r["kept_vs_ulysses"] = r["kept_bytes"] / base["kept_bytes"]
            print(
                f"  S={S:<6} {r['variant']:<16} {r['seconds'] * 1e3:8.1f} ms ({r['time_vs_ulysses']:.2f}x)  "
                f"sent {(r['fwd_bytes'] + r['bwd_bytes']) / 2**20:7.2f} MiB ({r['bytes_vs_ulysses']:.2f}x, "
                f"{r['fwd_calls']}+{r['bwd_calls']} calls)  peak {r['peak_bytes'] / 2**20:7.1f} MiB "
                f"({r['peak_vs_ulysses']:.2f}x)  kept fwd->bwd {r['kept_bytes'] / 2**20:6.1f} MiB "
                f"({r['kept_vs_ulysses']:.2f}x)"
            )
    write_json(args.json, {"args": vars(args), "rows": rows})
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
