"""The Ulysses SDPA context-parallel attention backend (registered with diffusers as ``ulysses_sdpa``).

Inside a diffusers model under ``enable_parallelism``, attention receives ``[B, S/P, H, D]`` per rank:

1. one all-to-all turns q, k, v into ``[B, S, H/P, D]`` (K/V keep their own, possibly fewer, heads);
2. ``torch.nn.functional.scaled_dot_product_attention`` runs on the local heads over the whole
   sequence under autograd, so backward is SDPA's own: no recomputation, nothing hand-derived;
3. one all-to-all returns the output to ``[B, S/P, H, D]``.

Ulysses x Ring (USP, ``ring_degree = R > 1``): after the Ulysses exchange each rank holds the queries and
K/V of its ring segment ``[B, S/R, H/U, D]``; K/V segments then stream around the ring and partial results
merge by log-sum-exp (``sp_diffusers.parallel.ring``: exact, backward included, K/V memory O(S/R)). With dropout
the ring all-gathers K/V instead (one softmax over every key). Heads need only divide U, so the SP
degree U x R is not capped by the head count.

Ranks may hold different local lengths (any sequence length, sharded as ``torch.tensor_split`` does). Inside
a model forward under a plan, every rank's lengths come from the forward's scope (``sp_diffusers.parallel.agreement``:
the ranks agreed the inputs once, the plan's splits say the lengths) with no communication; a direct call
starts with the per-call handshake (``sp_diffusers.parallel.agreement``) that tells every rank every rank's lengths and
refuses, on every rank at once, calls whose inputs disagree across the group. Masks (``sp_diffusers.parallel.masks``)
are normalised to SDPA's 4-D form ``[b, h, q, k]``; a key mask at the local length travels with K/V in their
all-to-all, another dim at the local length is all-gathered, per-head masks are sliced to the local heads.
On CUDA the local attention runs the fused kernels explicitly (``sp_diffusers.parallel.kernels``). Heads that do not divide P are zero-padded
(padded heads are dropped, so the result is exact); GQA keeps K/V compact when H_kv divides P. Glossary of
dimension letters: ``sp_diffusers.parallel.exchange``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .agreement import CallLayout, SPCallMismatch, agree, layout_by_view, remember, remembered, replay
from .agreement import current as current_scope
from .cp_groups import CPGroups, cp_groups
from .exchange import heads_to_seq, seq_to_heads
from .gathers import gather_seq
from .kernels import additive_mask, fused_attention, kernel_for
from .masks import MaskError, classify, key_padding_to_4d, prepare_mask
from .ring import ring_attention

if TYPE_CHECKING:  # pragma: no cover
    from diffusers.models._modeling_parallel import ParallelConfig

__all__ = ["UlyssesAttentionError", "local_sdpa_attention", "ulysses_sdpa_attention"]


class UlyssesAttentionError(ValueError):
    """Bad input to the Ulysses backend; the message names the parameter, its value and the fix."""


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
    """SDPA on ``[B, S, H, D]`` tensors with diffusers' mask conventions (the single-process path).

    On CUDA (and on ``meta``, its stand-in when tracing) it runs the fused kernels explicitly
    (``sp_diffusers.parallel.kernels``): never SDPA's math fallback with its score matrix. On CPU it is SDPA itself."""
    if attn_mask is not None:
        try:
            attn_mask = key_padding_to_4d(attn_mask, query.shape[0], (key.shape[1],))
        except MaskError as err:
            raise UlyssesAttentionError(str(err)) from None
    if kernel_for(query, attn_mask is not None) in ("flash", "efficient"):
        out = fused_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask,
            scale,
            is_causal,
            dropout_p,
        )
        return out.transpose(1, 2)
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


def _local_error(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    world: int,
) -> str | None:
    """What is wrong with this rank's own inputs (None: nothing). Reported through the handshake, so that a
    rank with bad inputs does not leave its peers waiting in a collective."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            return (
                f"{name} must be 4-D [B, S_local, H, D], got shape {tuple(t.shape)}; "
                "diffusers processors pass heads unflattened (tensor.unflatten(2, (heads, -1)))"
            )
    if not (query.dtype == key.dtype == value.dtype):
        return (
            f"query/key/value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}); "
            "cast them to one dtype before attention"
        )
    if not (query.device == key.device == value.device):
        return f"query/key/value are on different devices ({query.device}, {key.device}, {value.device})"
    if key.shape != value.shape:
        return f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}; ulysses_sdpa needs equal K/V shapes"
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        return f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree in batch or head dim"
    heads, kv_heads = query.shape[2], key.shape[2]
    if kv_heads != heads:
        if heads % kv_heads:
            return f"GQA needs the query heads ({heads}) to be a multiple of the key/value heads ({kv_heads})"
        if kv_heads % world:
            return (
                f"key/value heads H_kv={kv_heads} are not divisible by ulysses_degree={world}; "
                f"fix: use a ulysses_degree that divides {kv_heads}, or repeat K/V to {heads} heads "
                "(key.repeat_interleave(H // H_kv, dim=2)) before attention"
            )
    if attn_mask is not None and is_causal:
        return "pass either attn_mask or is_causal=True, not both (SDPA refuses the pair)"
    if attn_mask is not None and attn_mask.dim() > 4:
        return (
            f"attn_mask has {attn_mask.dim()} dims (shape {tuple(attn_mask.shape)}); SDPA masks have at most 4: "
            "pass [B, S_kv], [B, 1, 1, S_kv], [B, 1, S_q, S_kv] or [B, H, S_q, S_kv]"
        )
    return None


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
    """Attention on ``[B, S_local, H, D]`` per rank, exact w.r.t. SDPA on the unsharded ``[B, S, H, D]``.

    Without a context-parallel config (or with degree 1) it is plain SDPA. Local lengths may differ across
    ranks (any sequence length). The signature declares every argument diffusers' dispatcher may pass: the
    dispatcher silently drops undeclared ones.
    """
    if return_lse:
        raise UlyssesAttentionError(
            "return_lse=True is not supported by ulysses_sdpa: torch's SDPA does not return the log-sum-exp. "
            "Fix: call it with return_lse=False"
        )
    groups = cp_groups(_parallel_config)
    if groups is None:
        return local_sdpa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    error = _local_error(query, key, value, attn_mask, is_causal, groups.ulysses)
    try:
        layout = _call_layout(
            query, key, attn_mask, is_causal, dropout_p, scale, error, groups, _parallel_config
        )
        form = None
        if layout.mask_shapes is not None:
            form = classify(
                layout.mask_shapes, query.shape[0], query.shape[2], layout.q_sizes, layout.kv_sizes
            )
    except (SPCallMismatch, MaskError) as err:
        raise UlyssesAttentionError(str(err)) from None
    if query.shape[0] == 0:  # an empty batch on every rank (the handshake checked): nothing to exchange
        return local_sdpa_attention(query, key, value, None, dropout_p, False, scale, enable_gqa)
    return _attend(query, key, value, attn_mask, form, dropout_p, is_causal, scale, groups, layout)


def _call_layout(query, key, attn_mask, is_causal, dropout_p, scale, error, groups: CPGroups, config):
    """Every rank's lengths (and mask shapes) for this call: from the model forward's scope where it knows them
    (no communication), else from the per-call handshake (``sp_diffusers.parallel.agreement`` says when, and why
    every rank decides alike)."""
    scope = current_scope(config)
    mask_shape = tuple(attn_mask.shape) if attn_mask is not None else None
    local = (query.shape[1], key.shape[1], mask_shape) if query.dim() == 4 and key.dim() == 4 else None

    def handshake() -> CallLayout:
        if torch.compiler.is_compiling():  # a graph cannot read what the ranks answer
            raise UlyssesAttentionError(
                "ulysses_sdpa under torch.compile: this call's per-rank lengths are unknown (a call outside a model "
                "forward, or a sequence that does not divide the SP degree, first seen in a compiled forward); "
                "fix: run the first forward with these shapes uncompiled, or pad sequences to a multiple of the "
                "SP degree (parallel.pad_text_to_degree), or compile with sp_diffusers.engine.compiling"
            )
        return agree(query, key, attn_mask, is_causal, dropout_p, scale, error, groups.cp_group)

    if scope is None:  # outside a model forward: a direct call, or a call recomputed in backward
        found = replay(config, "attention", CallLayout.view, local) if error is None else None
        return found or handshake()
    if torch.compiler.is_compiling() and not scope.even and error is None:
        layout = layout_by_view(scope.signature, scope.split_key, local)
        if layout is not None:  # learned by an eager forward with these inputs (agreement.compilable)
            return layout
    key_of_call = None if scope.even else scope.next_call("attention")
    if scope.mode == "per_call":
        layout = handshake()
        _check_inferred(scope, layout, key_of_call)
    elif error is not None:
        # the scope's inputs were agreed (or trusted), so every rank reaches this same error here
        raise UlyssesAttentionError(f"ulysses_sdpa: {error}")
    elif key_of_call is None:
        world = groups.world
        layout = CallLayout(
            (local[0],) * world, (local[1],) * world, None if mask_shape is None else (mask_shape,) * world
        )
    else:
        layout = remembered(key_of_call)
        if layout is None:
            layout = handshake()
            remember(key_of_call, layout)
        elif layout.view(groups.cp_rank) != local:
            raise UlyssesAttentionError(
                f"ulysses_sdpa: this call's local lengths and mask {local} differ from those of the same call in an "
                f"earlier forward with the same input shapes ({layout.view(groups.cp_rank)}): the model's attention "
                "lengths depend on more than its input shapes and split lengths. Fix: "
                "sp_diffusers.set_rank_agreement(model, 'per_call') (debug_checks) for this model"
            )
    if not torch.compiler.is_compiling():  # for eager recomputation in backward; a graph recomputes itself
        scope.add("attention", layout)
    return layout


def _check_inferred(scope, layout: CallLayout, key_of_call) -> None:
    """``debug_checks``: the handshake's table against what the scope would have used (every rank sees the same
    table and the same scope, so every rank raises alike)."""
    if key_of_call is None:
        uniform = len(set(layout.q_sizes)) == 1 and len(set(layout.kv_sizes)) == 1
        if not uniform or (layout.mask_shapes is not None and len(set(layout.mask_shapes)) > 1):
            raise SPCallMismatch(
                f"ulysses_sdpa: every split of this forward divides the SP degree, yet the ranks' lengths differ "
                f"(query {list(layout.q_sizes)}, key {list(layout.kv_sizes)}): a sequence of this model is neither "
                "split by the plan nor whole on every rank, which the per-forward scope cannot size without asking. "
                "Fix: keep sp_diffusers.set_rank_agreement(model, 'per_call') for this model"
            )
        return
    known = remembered(key_of_call)
    if known is not None and known != layout:
        raise SPCallMismatch(
            f"ulysses_sdpa: this call's layout {layout} differs from the same call in an earlier forward with the "
            f"same input shapes ({known}); fix: keep sp_diffusers.set_rank_agreement(model, 'per_call') for this model"
        )
    remember(key_of_call, layout)


_ROW_SLOT_BYTES = 64  # per head of a key mask riding with K/V: the alignment of Q/K/V's rows is kept


def _key_rows(attn_mask, form, query, kv_sizes, cp_rank, ulysses, padded_heads) -> torch.Tensor | None:
    """A key mask at the local key length - one row of keys per batch entry (``[B, S_kv_local]``,
    ``[b, 1, 1, S_kv_local]``) or per head (``[b, H, 1, S_kv_local]``) - as ``[B, S_kv_local, heads, slot]`` of
    the query's dtype (additive, see :func:`_in_slots`), laid out like K so that it travels in K/V's collective:
    one copy of a shared row per destination, or each destination's own heads. None for any other mask (it is
    all-gathered)."""
    if attn_mask is None or form != ("1", "local") or attn_mask.dtype not in (torch.bool, query.dtype):
        return None
    mask = key_padding_to_4d(attn_mask, query.shape[0], (kv_sizes[cp_rank], sum(kv_sizes)))
    if mask.shape[2] != 1 or mask.shape[1] not in (1, query.shape[2]):
        return None
    rows = additive_mask(mask[:, :, 0, :], query.dtype).expand(query.shape[0], -1, -1).transpose(1, 2)
    if rows.shape[2] == 1:
        rows = rows.expand(-1, -1, ulysses)
    else:
        rows = F.pad(rows, (0, padded_heads - rows.shape[2]))  # padded heads: neutral (0)
    return _in_slots(rows)


def _in_slots(rows: torch.Tensor) -> torch.Tensor:
    """``[B, S, h]`` -> ``[B, S, h, slot]``, the value first: each head's mask value travels in a slot of 64
    bytes, so that the rows of the shared receive buffer keep the alignment of Q/K/V's own (an odd row width
    changed which CPU kernels SDPA ran, and so its rounding, between a rollout and a training forward)."""
    return F.pad(rows[..., None], (0, _ROW_SLOT_BYTES // rows.element_size() - 1))


def _attend(query, key, value, attn_mask, form, dropout_p, is_causal, scale, groups: CPGroups, layout):
    """The exchange, local SDPA (or the ring) and the exchange back, for inputs every rank agreed on."""
    ulysses, ring = groups.ulysses, groups.ring
    group, cp_rank = groups.ulysses_group, groups.cp_rank
    first = cp_rank - cp_rank % ulysses  # this Ulysses group's ranks (one ring segment) in the CP group
    uneven = len(set(layout.q_sizes)) > 1 or len(set(layout.kv_sizes)) > 1  # ranks hold different lengths
    q_sizes = layout.q_sizes[first : first + ulysses] if uneven else None
    kv_sizes = layout.kv_sizes[first : first + ulysses] if uneven else None

    heads, kv_heads = query.shape[2], key.shape[2]
    padded_heads = heads
    if kv_heads == heads and heads % ulysses:
        # Zero heads attend uniformly to zero values: their output is zero and is dropped below, and no
        # gradient reaches them, so padding changes no number of the real heads.
        padded_heads = -(-heads // ulysses) * ulysses
        pad = (0, 0, 0, padded_heads - heads)
        query, key, value = F.pad(query, pad), F.pad(key, pad), F.pad(value, pad)

    key_rows = _key_rows(attn_mask, form, query, layout.kv_sizes, cp_rank, ulysses, padded_heads)
    key_mask_dtype = attn_mask.dtype if key_rows is not None else None
    if key_rows is not None:
        attn_mask = None  # a local key-padding mask rides along with K/V: no collective of its own
    elif attn_mask is not None:
        attn_mask = prepare_mask(
            attn_mask,
            form,
            batch=query.shape[0],
            heads=heads,
            padded_heads=padded_heads,
            q_sizes=layout.q_sizes,
            kv_sizes=layout.kv_sizes,
            ulysses=ulysses,
            cp_rank=cp_rank,
            ulysses_group=group,
            cp_group=groups.cp_group,
        )

    seg_mask = None  # [B, h, 1, S_segment] additive: the key mask of this ring segment's keys, local heads
    if ulysses > 1 and key_rows is not None:
        # the mask rows ride in the K/V block of the same collective
        q, k, v, rows = seq_to_heads(
            [query, key, value, key_rows], group, [q_sizes, kv_sizes, kv_sizes, kv_sizes]
        )
        seg_mask = rows[..., 0].transpose(1, 2)[:, :, None, :]  # [B, h, 1, S_segment]
    elif ulysses > 1:
        # [B, S_segment, H/U, D] (K/V: H_kv/U); S_segment = this ring segment's length
        q, k, v = seq_to_heads([query, key, value], group, [q_sizes, kv_sizes, kv_sizes])
    else:
        q, k, v = query, key, value
        if key_rows is not None:
            seg_mask = key_rows[..., 0].transpose(1, 2)[:, :, None, :]
    if seg_mask is not None and key_mask_dtype == torch.bool:
        # back to the bool mask it was: SDPA then runs exactly what it runs for the gathered mask
        seg_mask = ~torch.isneginf(seg_mask)
    if seg_mask is not None and ring == 1:
        attn_mask = seg_mask
    if ring > 1:
        # every ring segment's length, and where this one starts (causal rows are global positions)
        seg_q = [sum(layout.q_sizes[r * ulysses : (r + 1) * ulysses]) for r in range(ring)]
        seg_kv = [sum(layout.kv_sizes[r * ulysses : (r + 1) * ulysses]) for r in range(ring)]
        q_start = sum(seg_q[: groups.ring_rank])
    if ring > 1 and dropout_p == 0.0:
        # The ring dimension: K/V segments stream around the ring, results merge by log-sum-exp.
        if k.shape[2] != q.shape[2]:
            k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        out = ring_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            groups.ring_group,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            kv_sizes=seg_kv if uneven else None,
            q_start=q_start,
            # only when there is one: ring_attention's callers and stand-ins without it stay valid
            **({"kv_mask": seg_mask} if seg_mask is not None else {}),
        ).transpose(1, 2)
    else:
        if ring > 1:
            # Dropout needs one softmax over all keys: all-gather K/V instead of streaming them.
            gathered = [k, v] if seg_mask is None else [k, v, _in_slots(seg_mask[:, :, 0, :].transpose(1, 2))]
            k, v, *rows = gather_seq(
                gathered, groups.ring_group, seg_kv if uneven else None
            )  # [B, S_kv, H/U, D]
            if rows:
                attn_mask = rows[0][..., 0].transpose(1, 2)[:, :, None, :]
            if is_causal:
                # SDPA's is_causal aligns query 0 with key 0; this segment's queries start at q_start
                rows = torch.arange(q.shape[1], device=q.device) + q_start
                attn_mask = (torch.arange(k.shape[1], device=q.device)[None, :] <= rows[:, None])[None, None]
                is_causal = False
        if ulysses > 1 and ring == 1 and q.device.type == "cpu":
            # SDPA's CPU kernel is faster, the copy included, on [B, H, S, D]-contiguous q/k/v than on the strided
            # views of the receive buffer (docs/benchmarks.md). Not on CUDA, whose fused kernels read [B, S, H, D]
            # rows as they are.
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        out = local_sdpa_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, kv_heads != heads)
    if ulysses > 1:
        (out,) = heads_to_seq([out], group, [q_sizes])  # [B, S_local, H_padded, D]
    if padded_heads != heads:
        out = out[:, :, :heads]
    return out
