"""The communication ledger on real gloo ranks: each collective's count and bytes, phases and kinds, FSDP's own
collectives told apart, nesting, and torch's functions restored afterwards. Returns plain data; the parent
asserts."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _entries(ledger) -> dict[str, tuple[int, int]]:
    return {f"{phase}/{kind}": v for (phase, kind), v in ledger.take().items()}


def collectives(rank: int, world: int) -> dict:
    import torch.distributed._functional_collectives as funcol

    from sp_diffusers.parallel.ledger import CommLedger, comm_kind, comm_phase

    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather", "all_reduce", "all_gather_object")}
    originals["funcol.all_gather_tensor"] = funcol.all_gather_tensor
    ledger = CommLedger()
    out: dict = {}
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4) + rank  # 96 bytes
    with ledger.recording():
        with comm_phase("rollout"):
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x)  # even: half of the 96 bytes leave
        out["a2a_even"] = _entries(ledger)
        with comm_phase("rollout"):
            splits_in = [1, 5] if rank == 0 else [2, 4]  # rows to rank 0, rank 1
            splits_out = [1, 2] if rank == 0 else [5, 4]
            z = x.new_empty(sum(splits_out), 4)
            dist.all_to_all_single(z, x, splits_out, splits_in)  # uneven: what leaves is the other rank's rows
        out["a2a_uneven"] = _entries(ledger)
        out["a2a_uneven_values"] = z.tolist()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        dist.all_gather_into_tensor(torch.empty(world * 6, 4), x)
        out["gathers"] = _entries(ledger)
        flag = torch.ones(3)
        dist.all_reduce(flag)  # an agreement by default: 2 x 12 x (P-1)/P bytes
        with comm_kind("grad_reduce"):
            dist.all_reduce(flag)
        dist.broadcast(flag, src=0)
        out["reduce_broadcast"] = _entries(ledger)
        with comm_phase("reward"):
            got: list = [None] * world
            dist.all_gather_object(got, {"rank": rank})
        out["object"] = _entries(ledger)
        with comm_phase("train_forward"):
            funcol.all_gather_tensor(x, 0, dist.group.WORLD)  # deprecated alias of all_gather_single: counted once
            funcol.all_to_all_single(x, None, None, dist.group.WORLD)
            funcol.all_reduce(flag, "sum", dist.group.WORLD)
        out["funcol"] = _entries(ledger)
        with comm_phase("rollout"):
            peer = 1 - rank
            recv = torch.empty(10)
            ops = [dist.P2POp(dist.isend, torch.ones(10), peer), dist.P2POp(dist.irecv, recv, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        out["p2p"] = _entries(ledger)
        inner = CommLedger()
        with inner.recording():
            dist.all_reduce(flag)
        dist.all_reduce(flag)
        out["nested_inner"], out["nested_outer"] = _entries(inner), _entries(ledger)
        out["during"] = dist.all_reduce is not originals["all_reduce"]
    out["restored"] = all(
        (getattr(dist, n) if "." not in n else funcol.all_gather_tensor) is fn for n, fn in originals.items()
    )
    dist.all_reduce(flag)
    out["after"] = _entries(ledger)
    return out


def fsdp(rank: int, world: int) -> dict:
    """A two-block model under FSDP2: its all-gathers are parameter gathers, its reduce-scatters gradient
    reductions; with the blocks held gathered, N forwards gather once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sp_diffusers.engine import held_params as gathering
    from sp_diffusers.parallel.ledger import CommLedger, comm_phase

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 8)
    ledger = CommLedger()
    out: dict = {"param_bytes": sum(p.numel() * 4 for p in model.parameters())}
    with ledger.recording():
        with comm_phase("train_forward"):
            loss = model(x).square().sum()
        with comm_phase("train_backward"):
            loss.backward()
        out["step"] = _entries(ledger)
        with torch.no_grad(), comm_phase("rollout"):
            for _ in range(3):
                model(x)
        out["per_forward"] = _entries(ledger)
        with torch.no_grad(), comm_phase("rollout"), gathering.held(model):
            first = model(x)
            for _ in range(2):
                again = model(x)
        out["held"] = _entries(ledger)
        out["held_equal"] = torch.equal(first, again)
        with torch.no_grad(), comm_phase("rollout"):
            model(x)  # resharded after the hold: gathered per forward again
        out["after_hold"] = _entries(ledger)
    out["gathered_bytes"] = gathering.gathered_bytes(model)
    return out
