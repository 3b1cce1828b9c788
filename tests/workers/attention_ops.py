"""Op-level checks of the all-to-all and of ``ulysses_sdpa_attention`` against full-sequence SDPA.

Each rank builds the same global tensors from a fixed seed, computes the single-process reference on
them, runs the sharded op on its slice, and reports max errors; the parent asserts. One process group
runs every case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import max_err, shard, ulysses_parallel_config


def _encode(b: int, s: int, h: int, d: int) -> torch.Tensor:
    """Values that spell out (batch, seq, head, dim), so any misplaced element is caught exactly."""
    bi = torch.arange(b).view(b, 1, 1, 1) * 1_000_000
    si = torch.arange(s).view(1, s, 1, 1) * 1_000
    hi = torch.arange(h).view(1, 1, h, 1) * 10
    di = torch.arange(d).view(1, 1, 1, d)
    return (bi + si + hi + di).to(torch.float64)


def all_to_all_checks(rank: int, world: int) -> dict:
    from sp_diffusers.parallel.exchange import heads_to_seq, seq_to_heads

    group = dist.group.WORLD
    out: dict[str, float] = {}
    B, S, H, D = 2, 4 * world, 2 * world, 3
    full = _encode(B, S, H, D)
    local = shard(full, 1, rank, world)
    (x,) = seq_to_heads([local], group)
    expected = full[:, :, rank * H // world : (rank + 1) * H // world]
    out["seq_to_heads_placement"] = max_err(x, expected)
    (back,) = heads_to_seq([x], group)
    out["round_trip"] = max_err(back, local)

    # Fused exchange of tensors with different heads, head dims and sequence lengths == one at a time.
    q = _encode(B, S, H, D)
    k = _encode(B, 2 * S, world, 5) + 0.5
    v = _encode(B, S, 3 * world, D) + 0.25
    locals_ = [shard(t, 1, rank, world) for t in (q, k, v)]
    fused = seq_to_heads(locals_, group)
    separate = [seq_to_heads([t], group)[0] for t in locals_]
    out["fused_equals_separate"] = max(max_err(a, b) for a, b in zip(fused, separate, strict=True))
    for name, t, got in zip("qkv", (q, k, v), fused, strict=True):
        h_l = t.shape[2] // world
        out[f"fused_placement_{name}"] = max_err(got, t[:, :, rank * h_l : (rank + 1) * h_l])
    back = heads_to_seq(fused, group)
    out["fused_round_trip"] = max(max_err(a, b) for a, b in zip(back, locals_, strict=True))

    # heads_to_seq sends a tensor laid out [S, B, H, D] in memory (SDPA's output for seq_to_heads' queries)
    # without packing it: same result as a contiguous [B, S, H, D] tensor that takes the packing path.
    per_rank = _encode(B, S, H // world, D) + rank * 0.5
    s_major = per_rank.transpose(0, 1).contiguous().transpose(0, 1)
    assert s_major.transpose(0, 1).is_contiguous() and not s_major.is_contiguous()
    out["zero_copy_send_equals_packed"] = max_err(
        heads_to_seq([s_major], group)[0], heads_to_seq([per_rank], group)[0]
    )

    # Backward of seq_to_heads is the inverse exchange: d/dx <y, g> with g encoding positions.
    src = local.clone().requires_grad_(True)
    (y,) = seq_to_heads([src], group)
    g = _encode(B, S, H // world, D)
    (y * g).sum().backward()
    grad_full = torch.zeros(B, S, H, D, dtype=torch.float64)
    grads = [torch.zeros_like(g) for _ in range(world)]
    dist.all_gather(grads, g.contiguous())
    for r in range(world):
        grad_full[:, :, r * H // world : (r + 1) * H // world] = grads[r]
    out["backward_is_inverse"] = max_err(src.grad, shard(grad_full, 1, rank, world))
    return out


def _case_tensors(seed: int, B: int, S_q: int, S_kv: int, H: int, H_kv: int, D: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S_q, H, D, generator=g)
    k = torch.randn(B, S_kv, H_kv, D, generator=g)
    v = torch.randn(B, S_kv, H_kv, D, generator=g)
    dout = torch.randn(B, S_q, H, D, generator=g)
    return q, k, v, dout


def _padding_mask(B: int, S_kv: int, seed: int, shortest: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(S_kv // 3 if shortest is None else shortest, S_kv + 1, (B,), generator=g)
    if shortest is not None:
        lengths[0] = shortest
    return torch.arange(S_kv)[None, :] < lengths[:, None]  # [B, S_kv] bool, ragged


def _cases(world: int) -> list[dict]:
    """Every case of the issue's item 3; masks are built on global tensors, then passed local or global."""
    S, H, D = 8 * world, 2 * world, 16
    cases: list[dict] = []

    def add(name, **kw):
        base = dict(
            B=2, S_q=S, S_kv=S, H=H, H_kv=H, D=D, mask=None, local_mask_dims=(), is_causal=False, scale=None
        )
        base.update(kw)
        base["name"] = name
        cases.append(base)

    add("plain")
    add("batch1", B=1)
    add("batch3", B=3)
    add("scale", scale=0.3)
    add("causal", is_causal=True)
    add("key_padding_2d_global_bool", mask="kp2d")
    add("key_padding_2d_local_bool", mask="kp2d", local_mask_dims=(-1,))
    add("key_padding_4d_global_bool", mask="kp4d")
    add("key_padding_4d_local_bool", mask="kp4d", local_mask_dims=(-1,))
    add("key_padding_4d_global_additive", mask="kp4d_add")
    add("key_padding_4d_local_additive", mask="kp4d_add", local_mask_dims=(-1,))
    # one sample keeps only its first keys: whole K/V segments (ring chunks) are masked out for it
    add("key_padding_short_local", mask="kp2d_short", local_mask_dims=(-1,))
    add("full_4d_global_bool", mask="full")
    add("full_4d_empty_rows", mask="full_empty_rows")
    add("full_4d_local_rows_bool", mask="full", local_mask_dims=(-2,))
    add("full_4d_global_additive", mask="full_add")
    add("broadcast_2d_sq_skv", mask="sq_skv", B=3)
    add("per_head_global_bool", mask="per_head")
    add("per_head_local_rows_bool", mask="per_head", local_mask_dims=(-2,))
    add("per_head_global_additive", mask="per_head_add")
    add("cross_attention", S_kv=2 * S)
    add("cross_attention_short_kv", S_q=2 * S, S_kv=S)
    add("cross_attention_key_padding_local", S_kv=2 * S, mask="kp2d", local_mask_dims=(-1,))
    # 2P - 1 keys: the last rank holds one, its local key mask has a dim of 1 (local length, not broadcast)
    add("key_padding_local_one_key_on_a_rank", S_kv=2 * world - 1, mask="kp2d", local_mask_dims=(-1,))
    add("cross_attention_per_head", S_kv=2 * S, mask="per_head")
    add("cross_attention_causal", S_kv=2 * S, is_causal=True)
    add("gqa", H=2 * world, H_kv=world)
    add("gqa_key_padding_local", H=4 * world, H_kv=world, mask="kp2d", local_mask_dims=(-1,))
    add("gqa_per_head_mask", H=2 * world, H_kv=world, mask="per_head")
    add("heads_not_divisible", H=world + 1, H_kv=world + 1)
    add("heads_not_divisible_per_head_mask", H=2 * world - 1, H_kv=2 * world - 1, mask="per_head")
    add("heads_not_divisible_key_padding", H=world + 1, H_kv=world + 1, mask="kp2d", local_mask_dims=(-1,))
    return cases


def _build_mask(kind: str | None, c: dict, seed: int) -> torch.Tensor | None:
    B, S_q, S_kv, H = c["B"], c["S_q"], c["S_kv"], c["H"]
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "kp2d":
        return _padding_mask(B, S_kv, seed)
    if kind == "kp2d_short":
        return _padding_mask(B, S_kv, seed, shortest=2)
    if kind == "kp4d":
        return _padding_mask(B, S_kv, seed)[:, None, None, :]
    if kind == "kp4d_add":
        m = _padding_mask(B, S_kv, seed)[:, None, None, :]
        return torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    if kind in ("full", "per_head"):
        h = H if kind == "per_head" else 1
        m = torch.rand(B, h, S_q, S_kv, generator=g) > 0.3
        m[..., 0] = True  # no fully masked row here; "full_empty_rows" has them
        return m
    if kind == "full_empty_rows":
        m = torch.rand(B, 1, S_q, S_kv, generator=g) > 0.3
        m[..., 0] = True
        m[:, :, ::5] = False  # rows that see no key: SDPA's CPU kernels give output 0 and gradient 0
        return m
    if kind == "full_add":
        return torch.randn(B, 1, S_q, S_kv, generator=g)
    if kind == "per_head_add":
        return torch.randn(B, H, S_q, S_kv, generator=g)
    if kind == "sq_skv":
        m = torch.rand(S_q, S_kv, generator=g) > 0.3
        m[..., 0] = True
        return m
    raise ValueError(kind)


def _errors(out, sp_in, ref, ref_in, cp_rank: int, cp_world: int) -> dict[str, float]:
    """Max |sharded - reference| of the output and of dq, dk, dv on this rank's slice."""
    errs = {"out": max_err(out, shard(ref, 1, cp_rank, cp_world))}
    for name, got, want in zip(("dq", "dk", "dv"), sp_in, ref_in, strict=True):
        errs[name] = max_err(got.grad, shard(want.grad, 1, cp_rank, cp_world))
    return errs


def _uneven(c: dict) -> dict:
    """The case at lengths that divide no degree > 1: S_q - 3 and S_kv - 1 (e.g. 13 / 15 at P = 2, split
    [7, 6] / [8, 7]; 29 / 31 at P = 4), so ranks hold different query and key counts."""
    return {**c, "S_q": c["S_q"] - 3, "S_kv": c["S_kv"] - 1, "name": f"uneven:{c['name']}"}


def _compare_cases(
    config, cp_rank: int, cp_world: int, kv_heads_multiple: int = 1, uneven: bool = True
) -> dict:
    """Every case, at even lengths and (``uneven``) at lengths that do not divide the degree: the sharded op
    on this rank's slice vs full-sequence SDPA; max errors per case."""
    from sp_diffusers.parallel.attention import local_sdpa_attention, ulysses_sdpa_attention

    results: dict[str, dict[str, float]] = {}
    cases = _cases(cp_world)
    cases += [_uneven(c) for c in cases] if uneven else []
    for i, c in enumerate(cases):
        if c["H_kv"] % kv_heads_multiple:
            continue
        q, k, v, dout = _case_tensors(100 + i, c["B"], c["S_q"], c["S_kv"], c["H"], c["H_kv"], c["D"])
        mask = _build_mask(c["mask"], c, 200 + i)
        kw = dict(is_causal=c["is_causal"], scale=c["scale"])

        # single-process reference on the full tensors
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = local_sdpa_attention(*ref_in, attn_mask=mask, **kw)
        ref.backward(dout)

        sp_in = [shard(t, 1, cp_rank, cp_world).clone().requires_grad_(True) for t in (q, k, v)]
        sp_mask = mask
        for dim in c["local_mask_dims"]:
            sp_mask = shard(sp_mask, dim, cp_rank, cp_world)
        out = ulysses_sdpa_attention(*sp_in, attn_mask=sp_mask, _parallel_config=config, **kw)
        out.backward(shard(dout, 1, cp_rank, cp_world))
        results[c["name"]] = _errors(out, sp_in, ref, ref_in, cp_rank, cp_world)
    return results


def attention_parity(rank: int, world: int) -> dict:
    return _compare_cases(ulysses_parallel_config(world), rank, world)


def dropout_is_applied(rank: int, world: int) -> dict:
    """dropout_p > 0 must change the result (never silently ignored); p = 0 must not."""
    from sp_diffusers.parallel.attention import ulysses_sdpa_attention

    config = ulysses_parallel_config(world)
    q, k, v, _ = _case_tensors(7, 1, 8 * world, 8 * world, 2 * world, 2 * world, 8)
    q, k, v = (shard(t, 1, rank, world) for t in (q, k, v))
    torch.manual_seed(rank)
    no_drop = ulysses_sdpa_attention(q, k, v, _parallel_config=config)
    dropped = ulysses_sdpa_attention(q, k, v, dropout_p=0.5, _parallel_config=config)
    again = ulysses_sdpa_attention(q, k, v, dropout_p=0.0, _parallel_config=config)
    return {
        "dropout_changes_output": max_err(no_drop, dropped),
        "no_dropout_repeatable": max_err(no_drop, again),
    }


def bad_inputs(rank: int, world: int) -> dict:
    """Each bad input raises on every rank, before any collective, with a message naming the fix."""
    from sp_diffusers.parallel.attention import ulysses_sdpa_attention

    config = ulysses_parallel_config(world)
    S, H, D = 4 * world, 2 * world, 8
    q = torch.randn(2, S // world, H, D)
    kv = torch.randn(2, S // world, H, D)
    cases = {
        "return_lse": lambda: ulysses_sdpa_attention(q, kv, kv, return_lse=True, _parallel_config=config),
        "dtype_mismatch": lambda: ulysses_sdpa_attention(q, kv.double(), kv, _parallel_config=config),
        "mask_wrong_shape": lambda: ulysses_sdpa_attention(
            q, kv, kv, attn_mask=torch.ones(2, S + 1, dtype=torch.bool), _parallel_config=config
        ),
        "mask_local_both_dims": lambda: ulysses_sdpa_attention(
            q,
            kv,
            kv,
            attn_mask=torch.ones(2, 1, S // world, S // world, dtype=torch.bool),
            _parallel_config=config,
        ),
        "mask_5d": lambda: ulysses_sdpa_attention(
            q, kv, kv, attn_mask=torch.ones(1, 2, 1, 1, S, dtype=torch.bool), _parallel_config=config
        ),
        "gqa_kv_heads_not_divisible": lambda: ulysses_sdpa_attention(
            torch.randn(2, S // world, 3 * world, D) if world > 1 else q,
            torch.randn(2, S // world, 3, D),
            torch.randn(2, S // world, 3, D),
            _parallel_config=config,
        ),
        "mask_and_causal": lambda: ulysses_sdpa_attention(
            q, kv, kv, attn_mask=torch.ones(2, S, dtype=torch.bool), is_causal=True, _parallel_config=config
        ),
        "three_dim_query": lambda: ulysses_sdpa_attention(q.flatten(2), kv, kv, _parallel_config=config),
    }
    messages = {}
    for name, fn in cases.items():
        try:
            fn()
        except ValueError as err:
            messages[name] = str(err)
        else:
            messages[name] = None
    dist.barrier()  # every rank got here: no rank is stuck in a collective
    return messages


def usp_parity(rank: int, world: int, ulysses: int, ring: int) -> dict:
    """Ulysses x Ring on a (dp, ring, ulysses) mesh: every op case vs full-sequence SDPA.

    With a ring, each case runs twice: with the CPU flash kernel (its log-sum-exp) and with the
    plain-math kernel of the dtypes no fused kernel takes ("math:" cases). K/V must stream: the all-gather is disabled
    while they run. Extra ring-only entries: bf16, and dropout (which takes the all-gather path).
    """
    from unittest import mock

    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    import sp_diffusers
    from sp_diffusers.parallel import attention, kernels

    mesh = sp_diffusers.build_device_mesh(ulysses_degree=ulysses, ring_degree=ring)
    config = ParallelConfig(
        context_parallel_config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    )
    config.setup(dist.get_rank(), world, torch.device("cpu"), mesh=mesh)
    # diffusers shards over the flattened (ring, ulysses) mesh: ring-major, Ulysses-minor
    cp_rank = mesh.get_local_rank("ring") * ulysses + mesh.get_local_rank("ulysses")
    cp_world = ulysses * ring
    if ring == 1:
        return _compare_cases(config, cp_rank, cp_world, kv_heads_multiple=ulysses)

    def no_gather(*_a, **_k):
        raise AssertionError("K/V were all-gathered: the ring must stream them")

    with mock.patch.object(attention, "gather_seq", no_gather):
        results = _compare_cases(config, cp_rank, cp_world, kv_heads_multiple=ulysses)
        with mock.patch.object(kernels, "kernel_for", lambda q, has_mask: "math"):
            math = _compare_cases(config, cp_rank, cp_world, kv_heads_multiple=ulysses)
    results.update({f"math:{name}": errs for name, errs in math.items()})

    # bf16: same ring, compared with fp32 SDPA; the bar is bf16 rounding of O(1) values (see the test)
    q, k, v, dout = _case_tensors(11, 2, 8 * cp_world, 8 * cp_world, 2 * ulysses, 2 * ulysses, 16)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = attention.local_sdpa_attention(*ref_in)
    ref.backward(dout)
    sp_in = [shard(t, 1, cp_rank, cp_world).bfloat16().requires_grad_(True) for t in (q, k, v)]
    out = attention.ulysses_sdpa_attention(*sp_in, _parallel_config=config)
    out.backward(shard(dout, 1, cp_rank, cp_world).bfloat16())
    results["bf16"] = _errors(out, sp_in, ref, ref_in, cp_rank, cp_world)

    # dropout > 0 goes through the all-gather and must change the result; p = 0 must reproduce it
    q_l, k_l, v_l = (shard(t, 1, cp_rank, cp_world) for t in (q, k, v))
    plain = attention.ulysses_sdpa_attention(q_l, k_l, v_l, _parallel_config=config)
    torch.manual_seed(rank)
    dropped = attention.ulysses_sdpa_attention(q_l, k_l, v_l, dropout_p=0.5, _parallel_config=config)
    results["dropout"] = {
        "changes_output": max_err(plain, dropped),
        "finite": float(torch.isfinite(dropped).all()),
        "no_dropout_matches_reference": max_err(plain, shard(ref, 1, cp_rank, cp_world)),
    }
    return results


def rank_mismatches(rank: int, world: int) -> dict:
    """The ranks of one SP group call attention with disagreeing inputs: every rank must raise the same
    error promptly (the handshake), none may wait in a collective. Also the edge lengths that do work."""
    import time

    from sp_diffusers.parallel.attention import local_sdpa_attention, ulysses_sdpa_attention

    config = ulysses_parallel_config(world)
    S, H, D = 4 * world, 2 * world, 8
    q = torch.randn(2, S // world, H, D)
    mine = rank == 0

    def call(query=q, key=q, attn_mask=None, **kw):
        return ulysses_sdpa_attention(query, key, key, attn_mask=attn_mask, _parallel_config=config, **kw)

    def both(x):  # query = key = value: a consistent call on each rank, inconsistent across ranks
        return call(x, x)

    cases = {
        "mask_on_one_rank": lambda: call(attn_mask=torch.ones(2, S, dtype=torch.bool) if mine else None),
        "global_vs_local_mask": lambda: call(
            attn_mask=torch.ones(2, S if mine else S // world, dtype=torch.bool)
        ),
        "causal_on_one_rank": lambda: call(is_causal=mine),
        "batch_differs": lambda: both(torch.randn(3 if mine else 2, S // world, H, D)),
        "heads_differ": lambda: both(torch.randn(2, S // world, 2 * H if mine else H, D)),
        "head_dim_differs": lambda: both(torch.randn(2, S // world, H, 2 * D if mine else D)),
        "dtype_differs": lambda: call(q.double() if mine else q, q.double() if mine else q),
        "scale_differs": lambda: call(scale=0.5 if mine else None),
        "local_error_on_one_rank": lambda: call(q.flatten(2) if mine else q),
    }
    out: dict = {}
    for name, fn in cases.items():
        start = time.perf_counter()
        try:
            fn()
            out[name] = {"message": None}
        except ValueError as err:
            out[name] = {"message": str(err), "type": type(err).__name__}
        out[name]["seconds"] = time.perf_counter() - start
        dist.barrier()

    # One token over `world` ranks: ranks 1.. hold none; and an empty batch. Both must equal one process.
    for name, (b, s) in {"one_token": (2, 1), "empty_batch": (0, S)}.items():
        g = torch.Generator().manual_seed(5)
        full = [torch.randn(b, s, H, D, generator=g) for _ in range(3)]
        ref_in = [t.clone().requires_grad_(True) for t in full]
        ref = local_sdpa_attention(*ref_in)
        ref.sum().backward()
        sp_in = [shard(t, 1, rank, world).clone().requires_grad_(True) for t in full]
        try:
            got = ulysses_sdpa_attention(*sp_in, _parallel_config=config)
            got.sum().backward()
            out[name] = {
                "out": max_err(got, shard(ref, 1, rank, world)),
                "dq": max_err(sp_in[0].grad, shard(ref_in[0].grad, 1, rank, world)),
            }
        except Exception as err:  # reported, the parent asserts
            out[name] = {"error": f"{type(err).__name__}: {err}"}
        dist.barrier()
    return out
