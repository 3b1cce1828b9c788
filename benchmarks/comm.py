"""Bytes sent per attention layer, counted (not estimated), against the Ulysses minimum.

    python benchmarks/comm.py [--seq 4096] [--heads 8] [--head-dim 64] [--world 2 4] [--json out.json]

Every collective ``ulysses_sdpa`` and diffusers' ``native`` Ulysses issue during one attention forward
and backward is intercepted (``torch.distributed`` functions and diffusers' functional all-to-all) and
its bytes that leave the rank are summed: for an all-to-all that is ``(P-1)/P`` of the buffer, for an
all-gather ``(P-1)/P`` of the output. The Ulysses minimum per direction is ``4 B S H D e (P-1) / P^2``
(Q, K, V in and the output back, each ``B S H D e / P`` per rank, ``(P-1)/P`` of it remote).

``ulysses_sdpa``'s per-call handshake (one all-gather of a few int64 per rank that tells every rank every
rank's lengths and refuses disagreeing inputs) is counted apart as ``*_handshake_*``: it is metadata whose
size does not grow with S, H or D.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import add_device_arguments, device, spawn, write_json


class _Counter:
    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0
        self.calls = 0
        self.handshake_bytes = 0
        self.handshake_calls = 0
        self.in_handshake = False

    def add(self, t: torch.Tensor, kind: str, group=None) -> None:
        """Bytes of ``t`` that leave this rank; the fraction depends on the collective's own group size."""
        n = t.numel() * t.element_size()
        p = dist.get_world_size(group) if group is not None else self.world
        if kind in ("a2a", "gather_out"):
            sent = n * (p - 1) // p
        elif kind == "all_reduce":  # ring all-reduce: reduce-scatter + all-gather
            sent = 2 * n * (p - 1) // p
        else:  # gather_in: my tensor goes to every peer
            sent = n * (p - 1)
        self.add_sent(sent)

    def add_sent(self, sent: int) -> None:
        """One collective that sends ``sent`` bytes from this rank."""
        if self.in_handshake:
            self.handshake_bytes += sent
            self.handshake_calls += 1
        else:
            self.bytes += sent
            self.calls += 1


def _group(args: tuple, kwargs: dict, position: int):
    """The ``group`` argument of a torch.distributed call, positional or keyword (None = world)."""
    if "group" in kwargs:
        return kwargs["group"]
    return args[position] if len(args) > position else None


@contextlib.contextmanager
def counting(counter: _Counter):
    """Count every collective and point-to-point send issued inside the block."""
    import torch.distributed._functional_collectives as funcol

    from sp_diffusers.parallel import agreement

    originals = {
        (agreement, "gather_ints"): agreement.gather_ints,
        (dist, "all_to_all_single"): dist.all_to_all_single,
        (dist, "all_gather"): dist.all_gather,
        (dist, "all_gather_into_tensor"): dist.all_gather_into_tensor,
        (dist, "all_reduce"): dist.all_reduce,
        (funcol, "all_to_all_single"): funcol.all_to_all_single,
        (dist, "batch_isend_irecv"): dist.batch_isend_irecv,
    }
    if hasattr(dist, "all_gather_single"):
        originals[(dist, "all_gather_single")] = dist.all_gather_single

    def a2a(output, input, *args, **kwargs):
        group = _group(args, kwargs, 2)
        splits = kwargs.get("input_split_sizes", args[1] if len(args) > 1 else None)
        if splits:  # in rows of dim 0: all but this rank's own block leaves it (the own block may be left out)
            n = input.numel() * input.element_size()
            counter.add_sent(n - splits[dist.get_rank(group)] * (n // max(1, input.shape[0])))
        else:
            counter.add(input, "a2a", group)
        return originals[(dist, "all_to_all_single")](output, input, *args, **kwargs)

    def gather(tensor_list, tensor, *args, **kwargs):
        counter.add(tensor, "gather_in", _group(args, kwargs, 0))
        return originals[(dist, "all_gather")](tensor_list, tensor, *args, **kwargs)

    def gather_into(out, inp, *args, **kwargs):
        counter.add(out, "gather_out", _group(args, kwargs, 0))
        return originals[(dist, "all_gather_into_tensor")](out, inp, *args, **kwargs)

    def gather_single(out, inp, *args, **kwargs):
        counter.add(out, "gather_out", _group(args, kwargs, 0))
        return originals[(dist, "all_gather_single")](out, inp, *args, **kwargs)

    def reduce(tensor, *args, **kwargs):
        counter.add(tensor, "all_reduce", _group(args, kwargs, 1))
        return originals[(dist, "all_reduce")](tensor, *args, **kwargs)

    def funcol_a2a(x, *args, **kwargs):
        counter.add(x, "a2a")
        return originals[(funcol, "all_to_all_single")](x, *args, **kwargs)

    def p2p(ops, *args, **kwargs):
        # the ring's neighbour exchange: every isend leaves the rank whole (one call per batch)
        counter.bytes += sum(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend
        )
        counter.calls += 1
        return originals[(dist, "batch_isend_irecv")](ops, *args, **kwargs)

    def metadata(*args, **kwargs):
        counter.in_handshake = True
        try:
            return originals[(agreement, "gather_ints")](*args, **kwargs)
        finally:
            counter.in_handshake = False

    agreement.gather_ints = metadata
    dist.all_to_all_single, dist.all_gather, dist.all_gather_into_tensor = a2a, gather, gather_into
    dist.all_reduce, dist.batch_isend_irecv = reduce, p2p
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single = gather_single
    funcol.all_to_all_single = funcol_a2a
    try:
        yield
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


def count_rank(rank: int, world: int, seq: int, heads: int, head_dim: int, batch: int) -> dict:
    import logging

    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import _native_attention
    from diffusers.utils import logging as dlogging
    from torch.distributed.device_mesh import init_device_mesh

    from sp_diffusers.parallel.attention import ulysses_sdpa_attention

    dlogging.set_verbosity(logging.ERROR)
    dev = device()
    mesh = init_device_mesh(dev.type, (1, world), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=world))
    config.setup(rank, world, dev, mesh=mesh)
    q, k, v = (
        torch.randn(batch, seq // world, heads, head_dim, device=dev, requires_grad=True) for _ in range(3)
    )
    mask = torch.ones(batch, seq // world, dtype=torch.bool, device=dev)
    out = {}
    for name, fn, kw in (
        ("ours", ulysses_sdpa_attention, {}),
        ("ours_key_padding_mask", ulysses_sdpa_attention, {"attn_mask": mask}),
        ("native", _native_attention, {}),
    ):
        fwd, bwd = _Counter(world), _Counter(world)
        with counting(fwd):
            o = fn(q, k, v, _parallel_config=config, **kw)
        with counting(bwd):
            o.sum().backward()
        out[name] = {
            "fwd_bytes": fwd.bytes,
            "bwd_bytes": bwd.bytes,
            "fwd_calls": fwd.calls,
            "bwd_calls": bwd.calls,
            "fwd_handshake_bytes": fwd.handshake_bytes,
            "fwd_handshake_calls": fwd.handshake_calls,
            "bwd_handshake_calls": bwd.handshake_calls,
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--json", default=None)
    add_device_arguments(
        p
    )  # bytes only (no clock): the device changes where the buffers live, not the counts
    args = p.parse_args(argv)
    rows = []
    print(
        f"bytes per rank per attention layer, S={args.seq} H={args.heads} D={args.head_dim} B={args.batch} fp32"
    )
    for world in args.world:
        counts = spawn(
            count_rank,
            world,
            args.seq,
            args.heads,
            args.head_dim,
            args.batch,
            backend=args.backend,
            device=args.device,
        )[0]
        minimum = 4 * args.batch * args.seq * args.heads * args.head_dim * 4 * (world - 1) // world**2
        for name, c in counts.items():
            row = {
                "P": world,
                "variant": name,
                **c,
                "minimum_per_direction": minimum,
                "fwd_ratio": c["fwd_bytes"] / minimum,
                "bwd_ratio": c["bwd_bytes"] / minimum,
            }
            rows.append(row)
            print(
                f"  P={world} {name:<22} fwd {c['fwd_bytes'] / 2**20:7.3f} MiB ({row['fwd_ratio']:.4f}x min, "
                f"{c['fwd_calls']} collectives)  bwd {c['bwd_bytes'] / 2**20:7.3f} MiB ({row['bwd_ratio']:.4f}x min, "
                f"{c['bwd_calls']} collectives)  handshake {c['fwd_handshake_bytes']} B in "
                f"{c['fwd_handshake_calls']} call"
            )
    write_json(args.json, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
