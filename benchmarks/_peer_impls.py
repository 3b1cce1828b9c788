"""The implementations ``benchmarks/peers.py`` compares, each ``attention(q, k, v)`` on ``[B, S/P, H, D]`` per
rank: ours (in a model forward's scope, and called directly), DeepSpeed's and yunchang's Ulysses (where
installed), a textbook exchange, diffusers' native Ulysses; and ``--exchange-only``'s stand-in for SDPA."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

INSTALL = {
    "deepspeed": "DS_BUILD_OPS=0 pip install --no-deps deepspeed && pip install torch==2.13.0 einops hjson "
    "msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm",
    "yunchang": "pip install torch==2.13.0 yunchang",
}


def _sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_, **kwargs) -> torch.Tensor:
    """SDPA on ``[B, S, H, D]`` tensors -> ``[B, S, H, D]`` (the peers' local-attention convention)."""
    scale = kwargs.get("softmax_scale")
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
    ).transpose(1, 2)


def _a2a(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    """The textbook exchange of one tensor: ``[B, S_l, H, D] -> [B, S, H/P, D]`` (``to_heads``) or back."""
    p = dist.get_world_size(group)
    b, s, h, d = x.shape
    if to_heads:  # destination-major [P, S_l, B, H/P, D]; received, source p's rows come p-th: [S, B, H/P, D]
        send = x.reshape(b, s, p, h // p, d).permute(2, 1, 0, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.reshape(p * s, b, h // p, d).transpose(0, 1)
    send = x.transpose(0, 1).contiguous().view(p, s // p, b, h, d)  # destination p: its rows, my heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(2, 1, 0, 3, 4).reshape(b, s // p, p * h, d)


class _Minimal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.to_heads = group, to_heads
        return _a2a(x, group, to_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _a2a(grad, ctx.group, not ctx.to_heads), None, None


def _minimal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    q, k, v = (_Minimal.apply(t, group, True) for t in (q, k, v))
    return _Minimal.apply(_sdpa_bshd(q, k, v), group, False)


def _module(package: str, *names: str):
    """The first of ``package``'s modules ``names`` that exists (layouts differ between checkouts)."""
    for name in names:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"{package} has none of {names}")


def _ours_in_scope(config, world: int, rank: int, package: str = "sp_diffusers"):
    """``ulysses_sdpa_attention`` of ``package`` inside a model forward's scope, as ``FSDPEngine`` runs it
    (``trusted``: the inputs are the same on every rank; every split even, so the call's lengths are its own)."""
    attention = _module(package, "parallel.attention", "attention")  # a checkout before the parallel/ package
    scopes = _module(package, "parallel.agreement", "forward_scope")  # has them at its root

    def call(q, k, v):
        scope = scopes.ForwardScope(config, world, rank, "trusted", ("peers", tuple(q.shape)))
        scopes.push(scope)
        try:
            return attention.ulysses_sdpa_attention(q, k, v, _parallel_config=config)
        finally:
            scopes.pop(scope)

    return call


def _implementations(config, world: int, rank: int, before_tree: str | None = None) -> tuple[dict, dict]:
    """(name -> attention on ``[B, S_l, H, D]`` q, k, v; name -> why absent) for this process's installs;
    ``ours_before`` is the ``sp_diffusers`` of the checkout ``before_tree`` (imported as ``sp_before``)."""
    from diffusers.models.attention_dispatch import _native_attention

    from sp_diffusers.parallel.attention import ulysses_sdpa_attention

    group = dist.group.WORLD
    fns = {
        "ours": _ours_in_scope(config, world, rank),
        "ours_direct": lambda q, k, v: ulysses_sdpa_attention(q, k, v, _parallel_config=config),
        "minimal": lambda q, k, v: _minimal(q, k, v, group),
        "native": lambda q, k, v: _native_attention(q, k, v, _parallel_config=config),
    }
    if before_tree:
        from benchmarks.uneven import _load_tree

        _load_tree(before_tree)
        fns["ours_before"] = _ours_in_scope(config, world, rank, "sp_before")
    absent = {}
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        ds = DistributedAttention(_sdpa_bshd, group, scatter_idx=2, gather_idx=1)
        fns["deepspeed"] = lambda q, k, v: ds(q, k, v, 0)
    except ImportError as err:
        absent["deepspeed"] = f"not installed ({err}); install: {INSTALL['deepspeed']}"
    try:
        from yunchang import UlyssesAttention
        from yunchang.kernels import AttnType

        yc = UlyssesAttention(group, scatter_idx=2, gather_idx=1, attn_type=AttnType.TORCH_FLASH)
        yc.attn_fn = _sdpa_bshd  # the local kernel held equal (see the module docstring)
        fns["yunchang"] = yc
    except ImportError as err:
        absent["yunchang"] = f"not installed ({err}); install: {INSTALL['yunchang']}"
    return fns, absent


class _StandIn(torch.autograd.Function):
    """``--exchange-only``: in place of SDPA, zeros allocated as the CPU kernel allocates them (the output in
    the query's ``[B, S, H, D]`` order, each gradient like its input): the exchanges and their copies see the
    layouts they see around the real kernel, whose seconds no longer drown them."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.inputs = (q, k, v)
        b, h, s = q.shape[:3]
        return q.new_zeros(b, s, h, v.shape[-1]).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return tuple(torch.zeros_like(t) for t in ctx.inputs)


def _stand_in(query, key, value, *args, **kwargs) -> torch.Tensor:
    return _StandIn.apply(query, key, value)
