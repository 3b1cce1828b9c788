"""Attention masks under sequence parallelism: any SDPA mask, local- or global-length, to the ``[b, h, q, k]``
mask of this rank's heads and query rows over every key.

After the exchange a rank computes the queries of its ring segment (all of them without ring) for
``H / ulysses`` heads over every key. A dim that is 1 stays 1 (broadcast), so a key-padding mask never becomes
O(S^2). A dim at the local length is all-gathered in the context-parallel group's rank order, which is the
global sequence order (ring-major, Ulysses-minor, as diffusers shards); ranks may hold different lengths.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .gathers import all_gather_along

__all__ = ["MaskError", "classify", "key_padding_to_4d", "prepare_mask"]


class MaskError(ValueError):
    """A mask that fits neither the local nor the global lengths (raised on every rank alike)."""


def key_padding_to_4d(mask: torch.Tensor, batch: int, kv_lens: tuple[int, ...]) -> torch.Tensor:
    """diffusers' convention: a 2-D mask ``[B, S_kv]`` is a key-padding mask, i.e. ``[B, 1, 1, S_kv]``;
    any other mask follows SDPA's broadcasting (leading dims added on the left)."""
    if mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] in kv_lens:
        return mask[:, None, None, :]
    if mask.dim() > 4:
        raise MaskError(
            f"attn_mask has {mask.dim()} dims (shape {tuple(mask.shape)}); SDPA masks have at most 4: "
            "pass [B, S_kv], [B, 1, 1, S_kv], [B, 1, S_q, S_kv] or [B, H, S_q, S_kv]"
        )
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def _as_4d(shape: tuple[int, ...], batch: int, kv_lens: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 2 and shape[0] == batch and shape[1] in kv_lens:
        return (shape[0], 1, 1, shape[1])
    return (1,) * (4 - len(shape)) + tuple(shape)


def classify(
    shapes: list[tuple[int, ...]], batch: int, heads: int, q_sizes: list[int], kv_sizes: list[int]
) -> tuple[str, str]:
    """The form of the query and key dims (``"1"``, ``"local"``, ``"global"``), the same on every rank.

    ``shapes`` are every rank's raw mask shapes (the handshake's table), so every rank reaches the same
    verdict: an error names the rank whose mask does not fit.
    """
    s_q, s_kv = sum(q_sizes), sum(kv_sizes)

    def fits(n: int, local: int, total: int) -> set[str]:
        # A rank holding one token reads a dim of 1 as broadcast or as its local length alike: the
        # other ranks' masks decide (a 7-token text mask split 2, 2, 2, 1 over 4 ranks is local everywhere).
        out = {"1"} if n == 1 and total != 1 else set()
        if n == total:
            out.add("global")
        if n == local:
            out.add("local")
        return out

    candidates = []
    for rank, shape in enumerate(shapes):
        b, h, q, k = _as_4d(shape, batch, (kv_sizes[rank], s_kv))
        fq, fk = fits(q, q_sizes[rank], s_q), fits(k, kv_sizes[rank], s_kv)
        if b not in (1, batch) or h not in (1, heads) or not fq or not fk:
            raise MaskError(
                f"attn_mask shape {tuple(shape)} on rank {rank} of the SP group fits neither local nor global "
                f"lengths: expected [b, h, q, k] with b in (1, {batch}), h in (1, {heads}), q in (1, "
                f"{q_sizes[rank]} local, {s_q} global), k in (1, {kv_sizes[rank]} local, {s_kv} global)"
            )
        candidates.append((fq, fk))

    def common(dim: int, preferred: tuple[str, ...]) -> str | None:
        # two forms fit on every rank only when every rank holds one token: a query dim of 1 is then read as
        # broadcast (key-padding masks), a key dim of 1 as the local length (masks split with the keys)
        shared = set.intersection(*(c[dim] for c in candidates))
        return next((f for f in preferred if f in shared), None)

    form = (common(0, ("global", "1", "local")), common(1, ("global", "local", "1")))
    if form[0] is None or form[1] is None:

        def shown(forms: set[str]) -> str:
            return "/".join(sorted(forms))

        per_rank = ", ".join(
            f"rank {r}: q {shown(fq)}, k {shown(fk)}" for r, (fq, fk) in enumerate(candidates)
        )
        raise MaskError(
            f"attn_mask has a different form on the ranks of the SP group ({per_rank}); fix: pass every rank "
            "a mask of the same form (all global-length, or all local-length)"
        )
    if form == ("local", "local"):
        shape = shapes[0]
        raise MaskError(
            f"attn_mask shape {tuple(shape)} has the local length on both the query ({_as_4d(shape, batch, (kv_sizes[0], s_kv))[2]}) "
            "and the key dim: it only covers this rank's diagonal block of the global mask. Pass the global mask "
            f"[.., {s_q}, {s_kv}], the rows of the local queries [.., {q_sizes[0]}, {s_kv}], or a key-padding mask"
        )
    return form


def prepare_mask(
    attn_mask: torch.Tensor,
    form: tuple[str, str],
    *,
    batch: int,
    heads: int,
    padded_heads: int,
    q_sizes: list[int],
    kv_sizes: list[int],
    ulysses: int,
    cp_rank: int,
    ulysses_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup,
) -> torch.Tensor:
    """``attn_mask`` (of the ``form`` :func:`classify` found) -> ``[b, h_local, q_segment, S_kv]`` for this rank.

    ``q_sizes``/``kv_sizes`` are every context-parallel rank's local lengths (ring-major); this rank's ring
    segment is the queries of the Ulysses group it belongs to.
    """
    mask = key_padding_to_4d(attn_mask, batch, (kv_sizes[cp_rank], sum(kv_sizes)))
    b, h = mask.shape[:2]
    first = cp_rank - cp_rank % ulysses  # the first rank of this Ulysses group (this ring segment)
    seg_sizes = q_sizes[first : first + ulysses]
    if form[0] == "local":
        mask = all_gather_along(mask, 2, ulysses_group, seg_sizes)  # the rows of this ring segment
    elif form[0] == "global" and len(q_sizes) > ulysses:
        start = sum(q_sizes[:first])
        mask = mask[:, :, start : start + sum(seg_sizes)]
    if form[1] == "local":
        mask = all_gather_along(mask, 3, cp_group, kv_sizes)
    if h == heads and heads > 1:
        if padded_heads != heads:
            neutral = torch.ones if mask.dtype == torch.bool else torch.zeros
            pad = neutral(
                (b, padded_heads - heads, mask.shape[2], mask.shape[3]), dtype=mask.dtype, device=mask.device
            )
            mask = torch.cat([mask, pad], dim=1)
        h_l = padded_heads // ulysses
        u_rank = cp_rank % ulysses
        mask = mask[:, u_rank * h_l : (u_rank + 1) * h_l]
    return mask
