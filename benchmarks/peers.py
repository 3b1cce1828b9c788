"""Ulysses attention side by side with its peers, on the same inputs in one run, every result checked exact.

    python benchmarks/peers.py [--seq 4096] [--heads 8] [--head-dim 64] [--rounds 15] [--json out.json] \
        [--plot out.png] [--only ours minimal floor] [--before-tree DIR] [--exchange-only]

One attention forward + backward per call, B = 1, 2 ranks x 1 thread (gloo, fp32) by default; each rank holds
``[B, S/P, H, D]`` of q, k, v and the output gradient. Implementations (per rank):
  ours          ``ulysses_sdpa_attention`` as a model forward runs it: inside the forward's scope (the ranks'
                lengths known, no handshake), one fused Q/K/V exchange and one output exchange each way
  ours_direct   the same called directly, outside a model forward: it opens with the per-call handshake
  ours_before   with ``--before-tree DIR``: ``ours`` of an earlier checkout (``git worktree add DIR <commit>``)
  deepspeed     ``deepspeed.sequence.layer.DistributedAttention`` (one all-to-all per tensor)
  yunchang      ``yunchang.UlyssesAttention`` (one all-to-all per tensor)
  minimal       a textbook exchange written here: ``all_to_all_single`` per tensor, permute copies, SDPA
  native        diffusers' own Ulysses (``_native_attention`` with a ContextParallelConfig; unpatched)
  floor         SDPA forward + backward on this rank's H/P heads over the whole S, no exchange: compute floor
The local attention is the same everywhere: ``torch.nn.functional.scaled_dot_product_attention`` (DeepSpeed and
yunchang take a local kernel as a parameter; yunchang's own are flash-attn's, which need CUDA), so the figures
compare what each does around it: the exchange, its copies and its autograd.

Timing: rounds, each running every implementation once, ranks starting together (barrier); round i starts at
the i-th implementation (so none always runs first); a sample is the slowest rank's time. Reported: medians,
the ratio of medians to the floor and to the best peer, and the median of the per-round ratios to the floor
(robust to the load drifting during a run), and CPU seconds per call of each rank's process (all threads:
the work, which a loaded machine inflates much less than the wall clock). Before timing, every implementation's
output and input gradients are checked against one process running SDPA on the whole unsharded tensors (all
heads): see ``ATOL``. ``--exchange-only`` replaces SDPA by a stand-in that allocates what SDPA allocates (and
checks nothing): what is left is each implementation's exchanges, copies and autograd.

Peers are registry packages, never needed by the project; install them into a venv of their own so the
project's stays as CI builds it (``torch==2.13.0`` pinned in every pip command: their requirements would pull
a CUDA torch)::

    python -m venv .venv-peers && P=.venv-peers/bin/pip
    $P install torch==2.13.0 diffusers==0.42.1 transformers peft accelerate matplotlib
    $P install torch==2.13.0 -e .                              # this checkout
    $P install torch==2.13.0 yunchang                          # pure Python; flash-attn is an optional extra
    DS_BUILD_OPS=0 $P install --no-deps deepspeed              # no kernels built, no CUDA torch pulled in
    $P install torch==2.13.0 einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm
    .venv-peers/bin/python benchmarks/peers.py --json peers.json --plot peers.png

DeepSpeed on CPU builds its shared-memory comm op with ninja and the C++ compiler at its first initialisation
(~40 s, cached under ~/.cache/torch_extensions); it is not used by the all-to-all measured here.

A peer that is not installed is reported absent, with the command that installs it, in the table, the JSON
and the plot: never left out silently.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import add_device_arguments, device, interleaved_samples, spawn, write_json
from benchmarks._peer_impls import _implementations, _stand_in
from benchmarks.attention import _parallel_config

IMPLS = ("ours", "ours_direct", "ours_before", "deepspeed", "yunchang", "minimal", "native", "floor")
PEERS = ("deepspeed", "yunchang", "minimal", "native")  # the "best peer" is the fastest of these
# Every implementation runs the same SDPA kernel on the same per-head numbers as the reference: the exchanges
# only move values, so any difference is summation order inside the kernel (the reference runs all H heads in
# one call, a rank H/P; diffusers' native backward is its own). fp32 softmax-weighted sums of S terms of O(1)
# differ by a few ulps of their O(1) partial sums in another order: 2e-5 absolute plus 1e-4 relative covers
# S = 4096 with margin and still fails anything wrongly placed (a swapped head or row is off by O(1)). Measured
# on this project's CPU host: 0.0 for every implementation (bitwise).
ATOL, RTOL = 2e-5, 1e-4


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    diff = (got.double() - ref.double()).abs()
    return diff.max().item(), bool((diff <= ATOL + RTOL * ref.double().abs()).all())


def bench_rank(
    rank: int,
    world: int,
    seq: int,
    heads: int,
    head_dim: int,
    rounds: int,
    only: list[str],
    stand_in: bool,
    before_tree: str | None = None,
):
    import logging

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    if stand_in:  # this rank is a process of its own: every caller of F.scaled_dot_product_attention gets it
        F.scaled_dot_product_attention = _stand_in
    dev, batch = device(), 1
    config = _parallel_config(world)
    g = torch.Generator().manual_seed(seq)
    q, k, v, dout = (torch.randn(batch, seq, heads, head_dim, generator=g).to(dev) for _ in range(4))
    # the reference: one process, every head, the whole sequence
    ref_in = [t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_in)
    ref_out.backward(dout.transpose(1, 2))
    ref = [ref_out.detach().transpose(1, 2), *(t.grad.transpose(1, 2) for t in ref_in)]  # [B, S, H, D]
    s_l, h_l = seq // world, heads // world
    rows, hs = slice(rank * s_l, (rank + 1) * s_l), slice(rank * h_l, (rank + 1) * h_l)
    local = [t[:, rows].contiguous() for t in (q, k, v, dout)]
    floor = [t[:, :, hs].transpose(1, 2).contiguous() for t in (q, k, v, dout)]  # SDPA's own [B, H/P, S, D]

    fns, absent = _implementations(config, world, rank, before_tree)
    absent = {n: why for n, why in absent.items() if not only or n in only}
    fns = {n: fns[n] for n in IMPLS if n in fns and (not only or n in only)}

    def sp_step(fn) -> list[torch.Tensor]:
        ins = [t.detach().requires_grad_(True) for t in local[:3]]
        out = fn(*ins)
        out.backward(local[3])
        return [out.detach(), *(t.grad for t in ins)]

    def floor_step() -> list[torch.Tensor]:
        ins = [t.detach().requires_grad_(True) for t in floor[:3]]
        out = F.scaled_dot_product_attention(*ins)
        out.backward(floor[3])
        return [x.transpose(1, 2) for x in (out.detach(), *(t.grad for t in ins))]

    steps = {n: (lambda fn=fn: sp_step(fn)) for n, fn in fns.items()}
    if not only or "floor" in only:
        steps["floor"] = floor_step
    checks = {}
    for name, step in steps.items():
        got = step()
        if stand_in:  # nothing to check: the stand-in is not attention
            checks[name] = {"max_abs_err": None, "exact": None}
            continue
        want = [r[:, :, hs] for r in ref] if name == "floor" else [r[:, rows] for r in ref]
        errs = dict(
            zip(
                ("out", "dq", "dk", "dv"),
                (_max_err(a, b) for a, b in zip(got, want, strict=True)),
                strict=True,
            )
        )
        checks[name] = {
            "max_abs_err": {w: e for w, (e, _) in errs.items()},
            "exact": all(ok for _, ok in errs.values()),
        }
    # CPU seconds of the rank's process (every thread: gloo's too) per call: the work, which a loaded machine
    # inflates less than the wall clock (time waiting for the peer or for a core is not in it)
    cpu: dict[str, list[float]] = {n: [] for n in steps}

    def clocked(name: str, step):
        def run() -> None:
            start = time.process_time()
            step()
            cpu[name].append(time.process_time() - start)

        return run

    samples = interleaved_samples({n: clocked(n, s) for n, s in steps.items()}, rounds, warmup=1, rotate=True)
    # a round's time is its slowest rank's; the first CPU sample of each is the warmup's
    table = torch.tensor([samples[n] for n in steps] + [cpu[n][1:] for n in steps], dtype=torch.float64)
    table = table.to(dev)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    rows = table.cpu().tolist()
    return {
        "samples_s": dict(zip(steps, rows[: len(steps)], strict=True)),
        "cpu_s": dict(zip(steps, rows[len(steps) :], strict=True)),
        "checks": checks,
        "absent": absent,
        "versions": _versions(),
    }


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found = {}
    for pkg in ("torch", "diffusers", "deepspeed", "yunchang"):
        try:
            found[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            found[pkg] = None
    return found


def summarize(result: dict) -> dict:
    """Medians, ratios to the floor and to the best peer present, per implementation (ms)."""
    samples = result["samples_s"]
    med = {n: statistics.median(ts) for n, ts in samples.items()}
    peers = [n for n in PEERS if n in med]
    best = min(peers, key=med.get) if peers else None
    rows = {}
    for name, ts in samples.items():
        cpu = statistics.median(result["cpu_s"][name])
        row = {"median_ms": med[name] * 1e3, "samples_ms": [t * 1e3 for t in ts], "cpu_ms": cpu * 1e3}
        if "floor" in med:
            row["vs_floor"] = med[name] / med["floor"]
            row["cpu_vs_floor"] = cpu / statistics.median(result["cpu_s"]["floor"])
            row["vs_floor_per_round"] = statistics.median(
                a / b for a, b in zip(ts, samples["floor"], strict=True)
            )
        if best is not None:
            row["vs_best_peer"] = med[name] / med[best]
        rows[name] = {**row, **result["checks"][name]}
    for name, why in result["absent"].items():
        rows[name] = {"absent": why}
    return {"best_peer": best, "implementations": rows}


def _plot(summary: dict, title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    names = [n for n in IMPLS if n in summary["implementations"]]
    rows = summary["implementations"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    for i, name in enumerate(names):
        row = rows[name]
        if "absent" in row:  # drawn as a labelled gap, never dropped
            ax.text(0, i, "  absent: not installed", va="center", color="gray")
            continue
        ax.barh(
            i, row["median_ms"], color="C1" if name.startswith("ours") else "C7" if name == "floor" else "C0"
        )
        label = f" {row['median_ms']:.0f} ms"
        if "vs_floor" in row:
            label += f"  {row['vs_floor']:.3f}x floor"
        ax.text(row["median_ms"], i, label, va="center")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set(xlabel="fwd+bwd ms (median of interleaved rounds, slowest rank)", title=title)
    ax.margins(x=0.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _print(summary: dict, title: str) -> None:
    print(f"\nUlysses attention fwd+bwd vs peers: {title}; best peer: {summary['best_peer']}")
    print(
        f"{'implementation':<14} {'median ms':>10} {'/floor':>7} {'/floor*':>8} {'/best peer':>10} "
        f"{'cpu ms':>8} {'cpu/floor':>9}  exact (max abs err)"
    )
    for name in IMPLS:
        row = summary["implementations"].get(name)
        if row is None:
            continue
        if "absent" in row:
            print(f"{name:<14} {'absent':>10}  {row['absent']}")
            continue
        cols = " ".join(
            f"{row.get(k, float('nan')):{w}.3f}"
            for k, w in (("vs_floor", 7), ("vs_floor_per_round", 8), ("vs_best_peer", 10))
        )
        exact = "n/a" if row["exact"] is None else f"{row['exact']} ({max(row['max_abs_err'].values()):.1e})"
        cpu = f"{row['cpu_ms']:8.1f} {row.get('cpu_vs_floor', float('nan')):9.3f}"
        print(f"{name:<14} {row['median_ms']:10.1f} {cols} {cpu}  {exact}")
    print(
        f"/floor* = median of the per-round ratios; cpu = CPU seconds of the rank's process per call (median, "
        f"slowest rank); exact: |err| <= {ATOL} + {RTOL} |reference| everywhere"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--only", nargs="+", default=[], choices=IMPLS, help="run only these implementations")
    p.add_argument(
        "--exchange-only", action="store_true", help="SDPA replaced by a stand-in: the exchanges' own cost"
    )
    p.add_argument(
        "--before-tree",
        default=None,
        help="a checkout of an earlier sp-diffusers: its ulysses_sdpa as ours_before",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    result = spawn(
        bench_rank,
        args.world,
        args.seq,
        args.heads,
        args.head_dim,
        args.rounds,
        args.only,
        args.exchange_only,
        args.before_tree,
        backend=args.backend,
        device=args.device,
    )[0]
    summary = summarize(result)
    title = (
        f"S={args.seq} H={args.heads} D={args.head_dim} B=1 fp32, {args.world} ranks ({args.backend}, "
        f"{args.device}), {args.rounds} rounds"
        + (", exchange only (SDPA stood in)" if args.exchange_only else "")
    )
    _print(summary, title)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    write_json(
        args.json,
        {
            "args": vars(args),
            "machine": machine,
            "versions": result["versions"],
            "tolerance": {"atol": ATOL, "rtol": RTOL},
            **summary,
        },
    )
    if args.plot:
        _plot(summary, title, args.plot)
    return 0 if all(r.get("exact") is not False for r in summary["implementations"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
