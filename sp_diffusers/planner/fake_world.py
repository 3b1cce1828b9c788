"""World size N in one CPU process: torch's fake process group, fake tensors, and what code that reads values
sees there.

The fake process group's collectives return at once and move no data; fake tensors have shapes but no values.
So the run simulates one rank of a rank-symmetric job:

- small integer gathers (``sp_diffusers.parallel.gathers.gather_ints``: the attention handshake, the uneven-shard gather,
  the engine's step agreement) return this rank's row for every rank, which is what every rank holds when the
  ranks run the same layout on the same micro-batch; except the local lengths of a sequence the plan sharded
  unevenly (``torch.tensor_split``'s rule): a row made only of such lengths gets every rank's own length, so a
  model that reshapes its gathered output (Wan's unpatchify) gets exactly its sequence back;
- a value read to the host (``.item()``, ``float(t)``, ``.tolist()``) of a fake tensor without a known value
  is a stand-in ``1`` of its dtype (``True``, ``1``, ``1.0``): the engine's metrics and its finite-norm check
  read such values after the work is done, and AdamW's bias correction reads its step counter;
- small integer and boolean tensors made from nothing or from other real tensors (masks, positions, lengths)
  stay real, with values: a model that selects tokens with a mask (HunyuanVideo-1.5 orders its text tokens with
  ``x[mask]``) gets outputs of the right length. Activations and parameters (floating point) are always fake;
- a ``DeviceMesh`` keeps real (tiny) tensors: meshes and sub-meshes are built with fake mode suspended,
  because torch computes a mesh's coordinates from tensor values;
- an ``ulysses_sdpa`` call's lengths are fitted to its mask's global length (:func:`fake_attention_agreement`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils import _pytree as pytree

__all__ = [
    "DEVICE_QUERY",
    "PlanFakeMode",
    "fake_attention_agreement",
    "fake_process_group",
    "mesh_outside_fake_mode",
    "symmetric_small_gathers",
]


_REAL_LIMIT = 1 << 22  # elements: a real (valued) integer/bool tensor of at most 32 MiB
DEVICE_QUERY = torch.ops.prim.device.default  # a fake tensor's device, asked from C++: most ops dispatched
_INDEX_OPS = (
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
)


def _valued(t: Any) -> bool:
    return torch.is_tensor(t) and not isinstance(t, FakeTensor) and not t.is_floating_point()


def _small(out: Any) -> bool:
    leaves = [t for t in pytree.tree_leaves(out) if torch.is_tensor(t)]
    return bool(leaves) and all(t.numel() <= _REAL_LIMIT and not t.is_floating_point() for t in leaves)


class PlanFakeMode(FakeTensorMode):
    """``FakeTensorMode`` with stand-ins for host reads and valued small integer/bool tensors (module doc)."""

    def __init__(self) -> None:
        # real tensors (a CPU scalar, a mesh, a mask) may meet fake ones
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is DEVICE_QUERY:  # a device query (most of the ops dispatched): nothing below applies to it
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        if func in _INDEX_OPS and isinstance(args[1], (list, tuple)):
            args = (args[0], _integer_indices(args[1]), *args[2:])
        tensors = [a for a in pytree.arg_tree_leaves(*args, **kwargs) if torch.is_tensor(a)]
        valued = all(_valued(t) for t in tensors)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except DynamicOutputShapeException:
            if not (valued and tensors):  # nonzero & co. of a fake tensor: no length to give
                raise
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        if valued and _small(out):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


def _integer_indices(indices: Any) -> list[Any]:
    """A valued boolean index becomes the integer indices of its True entries (one per mask dim)."""
    out: list[Any] = []
    for index in indices:
        if index is not None and _valued(index) and index.dtype == torch.bool:
            with unset_fake_temporarily():
                out.extend(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    """The default process group is a fake one of ``world`` ranks (this process is rank 0) inside this block;
    the process is left as it was (no process group) after it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "the planner needs its own fake process group, but this process already joined one; "
            "fix: run `sp-diffusers plan` (or sp_diffusers.planner) outside torchrun / init_process_group"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _outside_fake(fn):
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    wrapped.__planner_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped


_MESH_METHODS = ("__init__", "__getitem__", "_flatten", "get_group", "get_local_rank", "get_coordinate")


@contextlib.contextmanager
def mesh_outside_fake_mode() -> Iterator[None]:
    """DeviceMesh construction and lookups run with fake mode suspended (torch computes mesh coordinates from
    tensor values: ``nonzero`` has no fake implementation)."""
    from torch.distributed import device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    from ..parallel.mesh import ParallelDims

    saved = {
        name: DeviceMesh.__dict__[name] for name in (*_MESH_METHODS, "mesh") if name in DeviceMesh.__dict__
    }
    build, init = ParallelDims.build_mesh, device_mesh.init_device_mesh
    try:
        for name in _MESH_METHODS:
            if name in saved:
                setattr(DeviceMesh, name, _outside_fake(saved[name]))
        if "mesh" in saved:
            DeviceMesh.mesh = property(_outside_fake(saved["mesh"].fget))  # type: ignore[method-assign]
        ParallelDims.build_mesh = _outside_fake(build)  # type: ignore[method-assign]
        device_mesh.init_device_mesh = _outside_fake(init)
        yield
    finally:
        for name, value in saved.items():
            setattr(DeviceMesh, name, value)
        ParallelDims.build_mesh = build  # type: ignore[method-assign]
        device_mesh.init_device_mesh = init


_SPLITS: dict[tuple[int, int], list[int]] = {}  # (ranks, rank 0's length) -> every rank's length


def _symmetric_gather_ints(original: Any) -> Any:
    def gather(values: Any, group: Any, device: Any) -> list[list[int]]:
        # the real collective on the fake group, outside fake mode: it moves nothing and its result is not read,
        # but a recording ledger counts it as the job's would be (sp_diffusers.parallel.ledger)
        with unset_fake_temporarily():
            original(values, group, "cpu")
        world = dist.get_world_size(group)
        columns = [_SPLITS.get((world, int(v))) for v in values]
        if values and all(c is not None for c in columns):  # local lengths of sharded sequences
            return [[c[r] for c in columns] for r in range(world)]  # type: ignore[index]
        return [list(values) for _ in range(world)]

    return gather


@contextlib.contextmanager
def symmetric_small_gathers() -> Iterator[None]:
    """Every module that bound ``sp_diffusers.parallel.gathers.gather_ints`` sees every rank holding this rank's row, or
    every rank's own length of a sequence the plan sharded (recorded as the sharder splits it)."""
    from diffusers.hooks import context_parallel

    from ..parallel.exchange import split_sizes
    from ..parallel.gathers import gather_ints

    original = gather_ints
    bound = [
        m
        for name, m in list(sys.modules.items())
        if m is not None
        and (name.startswith("sp_diffusers") or name.startswith("patches"))
        and getattr(m, "gather_ints", None) is original
    ]
    sharder = context_parallel.EquipartitionSharder
    saved = sharder.__dict__["shard"]
    shard = saved.__func__

    def recording_shard(cls: Any, tensor: Any, dim: int, mesh: Any) -> Any:
        sizes = split_sizes(tensor.size(dim), mesh.size())
        _SPLITS.setdefault((mesh.size(), sizes[0]), sizes)
        return shard(cls, tensor, dim, mesh)

    _SPLITS.clear()
    try:
        symmetric = _symmetric_gather_ints(original)
        for module in bound:
            module.gather_ints = symmetric
        sharder.shard = classmethod(recording_shard)
        yield
    finally:
        for module in bound:
            module.gather_ints = original
        sharder.shard = saved
        _SPLITS.clear()


def _fit(sizes: list[int], length: int) -> list[int]:
    """Every rank's length when the ranks' lengths sum to ``length``: a rank-symmetric guess (every rank holds
    this rank's length) less one on the last ranks, as ``torch.tensor_split`` leaves them."""
    excess = sum(sizes) - length
    if 0 < excess < len(sizes):
        return [n - (i >= len(sizes) - excess) for i, n in enumerate(sizes)]
    return sizes


def _from_streams(sizes: list[int]) -> list[int]:
    """Every rank's length of a call whose sequence is made of streams the plan split in this forward (Qwen-Image's
    text + image), found from this rank's length: the largest set of recorded streams whose rank-0 lengths add up
    to it, summed rank by rank (a real job learns these once by a handshake: ``parallel/agreement.py``). Unchanged
    when the forward split evenly or no set adds up."""
    from itertools import combinations

    from ..parallel import agreement

    scope = agreement.current()
    if scope is None or scope.even or not scope.splits:
        return sizes
    streams = list(scope.splits.values())
    for n in range(len(streams), 0, -1):
        for chosen in combinations(streams, n):
            if sum(c[0] for c in chosen) == sizes[0]:
                return [sum(c[r] for c in chosen) for r in range(len(sizes))]
    return sizes


def _local_mask_shape(shape: tuple[int, ...], layout: Any, q: int, kv: int) -> tuple[int, ...]:
    """Rank 0's mask shape as a rank holding ``q`` queries and ``kv`` keys has it (local-length dims only)."""
    out = list(shape)
    if len(out) >= 1 and out[-1] == layout.kv_sizes[0] != 1:
        out[-1] = kv
    if len(out) == 4 and out[-2] == layout.q_sizes[0] != 1:
        out[-2] = q
    return tuple(out)


@contextlib.contextmanager
def fake_attention_agreement() -> Iterator[None]:
    """The lengths of an ``ulysses_sdpa`` call as a job's ranks hold them. On the fake process group no rank learns
    its peers' lengths: every rank is taken to hold this rank's, which is right for even shards but one token long
    per trailing rank for uneven ones, and a joint text+video mask (HunyuanVideo) has the true global length, so
    the call would be refused ("fits neither local nor global lengths"). Here the lengths are fitted to a mask's
    global length, as ``torch.tensor_split`` leaves them, or else made of the streams the forward split
    (:func:`_from_streams`): the bytes each rank sends are then the job's, to the byte."""
    from ..parallel import attention
    from ..parallel.agreement import CallLayout

    original = attention.agree

    def agree(query: Any, key: Any, attn_mask: Any, *args: Any) -> CallLayout:
        layout = original(query, key, attn_mask, *args)
        q, kv = _from_streams(list(layout.q_sizes)), _from_streams(list(layout.kv_sizes))
        if attn_mask is not None and attn_mask.dim() >= 2:
            kv = _fit(kv, attn_mask.shape[-1])
            if attn_mask.dim() == 4:
                q = _fit(q, attn_mask.shape[-2])
        shapes = layout.mask_shapes
        if shapes is not None:  # a mask at the local lengths has every rank's own
            shapes = tuple(_local_mask_shape(shapes[0], layout, q[r], kv[r]) for r in range(len(shapes)))
        return CallLayout(tuple(q), tuple(kv), shapes)

    attention.agree = agree
    try:
        yield
    finally:
        attention.agree = original
