"""The Ulysses SDPA context-parallel attention backend (registered with diffusers as ``ulysses_sdpa``).

Inside a diffusers model under ``enable_parallelism``, attention receives ``[B, S/P, H, D]`` per rank:

1. one all-to-all turns q, k, v into ``[B, S, H/P, D]`` (K/V keep their own, possibly fewer, heads);
2. ``torch.nn.functional.scaled_dot_product_attention`` runs on the local heads over the whole
   sequence under autograd, so backward is SDPA's own: no recomputation, nothing hand-derived;
3. one all-to-all returns the output to ``[B, S/P, H, D]``.

Ulysses x Ring (USP, ``ring_degree = R > 1``): after the Ulysses exchange each rank holds the queries and
K/V of its ring segment ``[B, S/R, H/U, D]``; K/V segments then stream around the ring and partial results
merge by log-sum-exp (``sp_diffusers.ring``: exact, backward included, K/V memory O(S/R)). With dropout
the ring all-gathers K/V instead (one softmax over every key). Heads need only divide U, so the SP
degree U x R is not capped by the head count.

Masks are normalised to SDPA's 4-D form ``[b, h, q, k]`` (b in {1, B}, h in {1, H}); a dim that has
the local length is all-gathered (a key-padding mask stays O(S)), per-head masks are sliced to the
local heads. Heads that do not divide P are zero-padded (padded heads are dropped, so the result is
exact); GQA keeps K/V compact when H_kv divides P. Glossary of dimension letters: ``sp_diffusers.comm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import all_gather_along, gather_ints, gather_seq, heads_to_seq, seq_to_heads
from .cp_groups import cp_groups
from .ring import ring_attention

if TYPE_CHECKING:  # pragma: no cover
    from diffusers.models._modeling_parallel import ParallelConfig

__all__ = ["UlyssesAttentionError", "local_sdpa_attention", "ulysses_sdpa_attention"]


class UlyssesAttentionError(ValueError):
    """Bad input to the Ulysses backend; the message names the parameter, its value and the fix."""


def _key_padding_to_4d(mask: torch.Tensor, batch: int, kv_lens: tuple[int, ...]) -> torch.Tensor:
    """diffusers' convention: a 2-D mask ``[B, S_kv]`` is a key-padding mask, i.e. ``[B, 1, 1, S_kv]``;
    any other mask follows SDPA's broadcasting (leading dims added on the left)."""
    if mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] in kv_lens:
        return mask[:, None, None, :]
    if mask.dim() > 4:
        raise UlyssesAttentionError(
            f"attn_mask has {mask.dim()} dims (shape {tuple(mask.shape)}); SDPA masks have at most 4: "
            "pass [B, S_kv], [B, 1, 1, S_kv], [B, 1, S_q, S_kv] or [B, H, S_q, S_kv]"
        )
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def local_sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Plain SDPA on ``[B, S, H, D]`` tensors with diffusers' mask conventions (the single-process path)."""
    if attn_mask is not None:
        attn_mask = _key_padding_to_4d(attn_mask, query.shape[0], (key.shape[1],))
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa or key.shape[2] != query.shape[2],
    )
    return out.transpose(1, 2)


def _validate_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world: int) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise UlyssesAttentionError(
                f"{name} must be 4-D [B, S_local, H, D], got shape {tuple(t.shape)}; "
                "diffusers processors pass heads unflattened (tensor.unflatten(2, (heads, -1)))"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise UlyssesAttentionError(
            f"query/key/value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}); "
            "cast them to one dtype before attention"
        )
    if not (query.device == key.device == value.device):
        raise UlyssesAttentionError(
            f"query/key/value are on different devices ({query.device}, {key.device}, {value.device})"
        )
    if key.shape != value.shape:
        raise UlyssesAttentionError(
            f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}; ulysses_sdpa needs equal K/V shapes"
        )
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        raise UlyssesAttentionError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree in batch or head dim"
        )
    heads, kv_heads = query.shape[2], key.shape[2]
    if kv_heads != heads:
        if heads % kv_heads:
            raise UlyssesAttentionError(
                f"GQA needs the query heads ({heads}) to be a multiple of the key/value heads ({kv_heads})"
            )
        if kv_heads % world:
            raise UlyssesAttentionError(
                f"key/value heads H_kv={kv_heads} are not divisible by ulysses_degree={world}; "
                f"fix: use a ulysses_degree that divides {kv_heads}, or repeat K/V to {heads} heads "
                "(key.repeat_interleave(H // H_kv, dim=2)) before attention"
            )


def _prepare_mask(
    attn_mask: torch.Tensor,
    *,
    batch: int,
    heads: int,
    padded_heads: int,
    s_q_local: int,
    s_kv_local: int,
    ulysses: int,
    ulysses_rank: int,
    ulysses_group: dist.ProcessGroup,
    ring: int = 1,
    ring_rank: int = 0,
    cp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Any SDPA mask, local- or global-length -> a ``[b, h, q, S_kv]`` mask for this rank's heads and rows.

    After the exchange a rank computes the queries of its ring segment (``q = S_q / ring`` rows; all of
    them without ring) for ``H / ulysses`` heads over every key. A dim that is 1 stays 1 (broadcast), so
    a key-padding mask never becomes O(S^2). Local lengths are gathered in the CP group's rank order,
    which is the global sequence order (ring-major, Ulysses-minor, as diffusers shards).
    """
    world = ulysses * ring
    s_q, s_kv = s_q_local * world, s_kv_local * world
    segment = s_q_local * ulysses
    mask = _key_padding_to_4d(attn_mask, batch, (s_kv_local, s_kv))
    b, h, q, k = mask.shape
    expected = (
        f"expected [b, h, q, k] with b in (1, {batch}), h in (1, {heads}), q in (1, {s_q_local} local, "
        f"{s_q} global), k in (1, {s_kv_local} local, {s_kv} global)"
    )
    if (
        b not in (1, batch)
        or h not in (1, heads)
        or q not in (1, s_q_local, s_q)
        or k not in (1, s_kv_local, s_kv)
    ):
        raise UlyssesAttentionError(
            f"attn_mask shape {tuple(attn_mask.shape)} fits neither local nor global lengths: {expected}"
        )
    gather_q = q == s_q_local and q != 1
    gather_k = k == s_kv_local and k != 1
    if gather_q and gather_k:
        raise UlyssesAttentionError(
            f"attn_mask shape {tuple(attn_mask.shape)} has the local length on both the query ({q}) and the "
            "key dim: it only covers this rank's diagonal block of the global mask. Pass the global mask "
            f"[.., {s_q}, {s_kv}], the rows of the local queries [.., {s_q_local}, {s_kv}], or a key-padding mask"
        )
    if gather_q:
        mask = all_gather_along(mask, 2, ulysses_group)  # the rows of this ring segment
    elif q == s_q and ring > 1:
        mask = mask[:, :, ring_rank * segment : (ring_rank + 1) * segment]
    if gather_k:
        mask = all_gather_along(mask, 3, cp_group if cp_group is not None else ulysses_group)
    if h == heads and heads > 1:
        if padded_heads != heads:
            neutral = torch.ones if mask.dtype == torch.bool else torch.zeros
            pad = neutral(
                (b, padded_heads - heads, mask.shape[2], mask.shape[3]), dtype=mask.dtype, device=mask.device
            )
            mask = torch.cat([mask, pad], dim=1)
        h_l = padded_heads // ulysses
        mask = mask[:, ulysses_rank * h_l : (ulysses_rank + 1) * h_l]
    return mask


def ulysses_sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: ParallelConfig | None = None,
) -> torch.Tensor:
    """Attention on ``[B, S/P, H, D]`` per rank, exact w.r.t. SDPA on the unsharded ``[B, S, H, D]``.

    Without a context-parallel config (or with degree 1) it is plain SDPA. The signature declares every
    argument diffusers' dispatcher may pass: the dispatcher silently drops undeclared ones.
    """
    if return_lse:
        raise UlyssesAttentionError(
            "return_lse=True is not supported by ulysses_sdpa: torch's SDPA does not return the log-sum-exp. "
            "Fix: call it with return_lse=False"
        )
    groups = cp_groups(_parallel_config)
    if groups is None:
        return local_sdpa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and is_causal:
        raise UlyssesAttentionError(
            "pass either attn_mask or is_causal=True, not both (SDPA refuses the pair)"
        )

    ulysses, ring = groups.ulysses, groups.ring
    group, rank = groups.ulysses_group, groups.ulysses_rank
    ring_group, ring_rank, cp_group = groups.ring_group, groups.ring_rank, groups.cp_group
    _validate_qkv(query, key, value, ulysses)

    if groups.anything:
        _check_even_lengths(query, key, group)

    batch, s_q_local, heads, _ = query.shape
    kv_heads = key.shape[2]
    padded_heads = heads
    if kv_heads == heads and heads % ulysses:
        # Zero heads attend uniformly to zero values: their output is zero and is dropped below, and no
        # gradient reaches them, so padding changes no number of the real heads.
        padded_heads = -(-heads // ulysses) * ulysses
        pad = (0, 0, 0, padded_heads - heads)
        query, key, value = F.pad(query, pad), F.pad(key, pad), F.pad(value, pad)

    if attn_mask is not None:
        attn_mask = _prepare_mask(
            attn_mask,
            batch=batch,
            heads=heads,
            padded_heads=padded_heads,
            s_q_local=s_q_local,
            s_kv_local=key.shape[1],
            ulysses=ulysses,
            ulysses_rank=rank,
            ulysses_group=group,
            ring=ring,
            ring_rank=ring_rank,
            cp_group=cp_group,
        )

    if ulysses > 1:
        q, k, v = seq_to_heads([query, key, value], group)  # [B, S/R, H/U, D] (K/V: H_kv/U)
    else:
        q, k, v = query, key, value
    if ring > 1 and dropout_p == 0.0:
        # The ring dimension: K/V segments stream around the ring, results merge by log-sum-exp.
        if k.shape[2] != q.shape[2]:
            k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        out = ring_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            ring_group,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
        ).transpose(1, 2)
    else:
        if ring > 1:
            # Dropout needs one softmax over all keys: all-gather K/V instead of streaming them.
            k, v = gather_seq([k, v], ring_group)  # [B, S_kv, H/U, D]
            if is_causal:
                # SDPA's is_causal aligns query 0 with key 0; this segment's queries start at ring_rank * S/R
                rows = torch.arange(q.shape[1], device=q.device) + ring_rank * q.shape[1]
                attn_mask = (torch.arange(k.shape[1], device=q.device)[None, :] <= rows[:, None])[None, None]
                is_causal = False
        out = local_sdpa_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, kv_heads != heads)
    if ulysses > 1:
        (out,) = heads_to_seq([out], group)  # [B, S/(U R), H_padded, D]
    if padded_heads != heads:
        out = out[:, :, :heads]
    return out


def _check_even_lengths(query: torch.Tensor, key: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``ulysses_anything`` may hand ranks different local lengths; say so instead of hanging or erring later."""
    sizes = gather_ints([query.shape[1], key.shape[1]], group, query.device)
    if any(s != sizes[0] for s in sizes):
        raise UlyssesAttentionError(
            f"local sequence lengths differ across the Ulysses group (per rank [S_q, S_kv]: {sizes}); "
            "ulysses_sdpa needs S divisible by ulysses_degree. Fix: pad the sequence to a multiple of the "
            "ulysses_degree (sp_diffusers.padding), or choose a ulysses_degree that divides it"
        )
