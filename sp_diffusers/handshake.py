"""What the ranks of a sequence-parallel group agree on before an attention call moves any data.

Every collective of the Ulysses exchange assumes its peers call it with matching arguments: a rank with a
mask while its peer has none, another batch or head count, ``is_causal`` on one rank only, or a local error
that one rank raises while the others enter the all-to-all, would hang the group or silently mix two
different attentions. So each call starts with one small all-gather of what each rank is about to do
(shapes, dtype, mask form, flags, its local error if any): every rank then sees the same table and either
proceeds, with every rank's sequence lengths (uneven shards need them for the split sizes), or raises the
same error, naming the input, the ranks and their values.

That per-call handshake is for calls outside a model forward (direct calls of the backend) and for
``debug_checks``. Inside a plan-driven forward the ranks agree once, at the model's entry, on everything the
calls derive from: :func:`agree_forward` compares one digest of the model and of every input's shape, dtype
and value (plain Python values; tensors by shape and dtype) - one collective and one host sync per forward -
and on a mismatch tells every rank which input differs on which ranks.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .comm import gather_ints

__all__ = ["CallLayout", "SPCallMismatch", "agree", "agree_forward", "describe"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool)
# field name -> (what it is, the fix when ranks disagree)
_MUST_AGREE = {
    "batch": ("the batch size of query", "every rank of an SP group must run the same micro-batch"),
    "heads": ("the number of query heads", "every rank must run the same model"),
    "kv_heads": ("the number of key/value heads", "every rank must run the same model"),
    "head_dim": ("the head dim", "every rank must run the same model"),
    "dtype": ("the dtype of query/key/value", "cast every rank's inputs to one dtype"),
    "mask": (
        "whether attn_mask is given, its shape form and dtype",
        "pass the same kind of mask on every rank",
    ),
    "is_causal": ("is_causal", "pass the same is_causal on every rank"),
    "dropout_p": ("dropout_p", "pass the same dropout_p on every rank"),
    "scale": ("scale", "pass the same scale on every rank"),
}


class SPCallMismatch(ValueError):
    """The ranks of an SP group called attention with disagreeing inputs (raised on every rank)."""


@dataclass(frozen=True)
class CallLayout:
    """Every rank's local lengths, in the context-parallel group's rank order, and the mask's raw shapes."""

    q_sizes: tuple[int, ...]
    kv_sizes: tuple[int, ...]
    mask_shapes: tuple[tuple[int, ...], ...] | None  # each rank's attn_mask shape (None: no mask anywhere)

    def view(self, rank: int) -> tuple:
        """What ``rank`` sees of this layout on its own: its lengths and its mask's shape."""
        return (
            self.q_sizes[rank],
            self.kv_sizes[rank],
            None if self.mask_shapes is None else self.mask_shapes[rank],
        )

    @property
    def uneven(self) -> bool:
        return len(set(self.q_sizes)) > 1 or len(set(self.kv_sizes)) > 1


def _float_bits(x: float | None) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + hash(str(dtype)) % 1000


def agree(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    local_error: str | None,
    group: dist.ProcessGroup,
) -> CallLayout:
    """One all-gather over ``group``: raise the same error on every rank when any rank failed locally or the
    ranks disagree; else every rank's lengths. ``query``/``key`` are ``[B, S_local, H, D]`` (4-D when
    ``local_error`` is None)."""
    four_d = query.dim() == 4 and key.dim() == 4
    mask_shape = list(attn_mask.shape) if attn_mask is not None else []
    row = [
        int(local_error is not None),
        *(query.shape[:1] if four_d else [-1]),
        query.shape[1] if four_d else -1,
        key.shape[1] if four_d else -1,
        query.shape[2] if four_d else -1,
        key.shape[2] if four_d else -1,
        query.shape[3] if four_d else -1,
        _code(query.dtype),
        len(mask_shape) if attn_mask is not None else -1,
        *(mask_shape + [0] * (4 - len(mask_shape)))[:4],
        _code(attn_mask.dtype) if attn_mask is not None else -1,
        int(bool(is_causal)),
        _float_bits(dropout_p),
        _float_bits(scale),
    ]
    table = gather_ints(row, group, query.device)
    ranks = dist.get_process_group_ranks(group)
    failed = [i for i, r in enumerate(table) if r[0]]
    if failed:
        messages: list[str | None] = [None] * len(table)
        dist.all_gather_object(messages, local_error, group=group)
        details = "; ".join(f"rank {ranks[i]}: {messages[i]}" for i in failed)
        raise SPCallMismatch(
            f"ulysses_sdpa: {len(failed)} rank(s) of the SP group refused the call: {details}"
        )
    columns = {
        "batch": [r[1] for r in table],
        "heads": [r[4] for r in table],
        "kv_heads": [r[5] for r in table],
        "head_dim": [r[6] for r in table],
        "dtype": [str(_DTYPES[r[7]]) if r[7] < len(_DTYPES) else r[7] for r in table],
        "mask": [
            "none" if r[8] < 0 else f"{r[8]}-D {'bool' if r[13] == _DTYPES.index(torch.bool) else 'additive'}"
            for r in table
        ],
        "is_causal": [bool(r[14]) for r in table],
        "dropout_p": [r[15] for r in table],
        "scale": [r[16] for r in table],
    }
    for name, values in columns.items():
        if len({str(v) for v in values}) > 1:
            what, fix = _MUST_AGREE[name]
            shown = values
            if name in ("dropout_p", "scale"):
                shown = [None if v == -1 else struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
            per_rank = ", ".join(f"rank {ranks[i]}: {v}" for i, v in enumerate(shown))
            raise SPCallMismatch(
                f"ulysses_sdpa: the ranks of the SP group disagree on {what} ({per_rank}); fix: {fix}"
            )
    mask_shapes = None
    if table[0][8] >= 0:
        mask_shapes = tuple(tuple(r[9 : 9 + r[8]]) for r in table)
    return CallLayout(tuple(r[2] for r in table), tuple(r[3] for r in table), mask_shapes)


def describe(name: str, value: Any, out: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """``(name, description)`` of every leaf of a forward input, containers flattened into dotted names:
    tensors by shape, dtype and device type (not device index, not values), plain values as they are, other
    objects by type. Rank-independent, so that every rank of an SP group describes the same inputs alike."""
    out = [] if out is None else out
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        out.append((name, f"tensor{list(value.shape)} {dtype} on {value.device.type}"))
    elif isinstance(value, dict):
        if not value:
            out.append((name, "{}"))
        for k, v in value.items():
            describe(f"{name}.{k}", v, out)
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append((name, repr(value)))
        for i, v in enumerate(value):
            describe(f"{name}[{i}]", v, out)
    elif value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        out.append((name, repr(value)))
    else:
        out.append((name, f"a {type(value).__name__}"))
    return out


def _digest(signature: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=8).digest(), "little") >> 1


def _first_difference(rows: list[Any], ranks: list[int]) -> str:
    """The first input whose description differs across the ranks, with each rank's."""
    named = [dict(row) for row in rows]
    for name in dict.fromkeys(n for row in named for n in row):
        values = [row.get(name, "(absent)") for row in named]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {ranks[i]}: {v}" for i, v in enumerate(values))
            return f"{name} ({per_rank})"
    return "the order of their inputs"


def agree_forward(signature: list[tuple[str, str]], group: dist.ProcessGroup, device: torch.device) -> None:
    """The once-per-forward agreement: one all-gather of a digest of ``signature`` (``(name, description)`` of
    the model and of every input, see :func:`describe`); on a mismatch every rank raises the same
    :class:`SPCallMismatch`, naming the first input that differs and every rank's description of it."""
    table = gather_ints([_digest(signature)], group, device)
    if len({row[0] for row in table}) == 1:
        return
    rows: list[Any] = [None] * len(table)
    dist.all_gather_object(rows, signature, group=group)
    raise SPCallMismatch(
        "sp_diffusers: the ranks of the SP group called the model with different inputs: "
        f"{_first_difference(rows, dist.get_process_group_ranks(group))}; fix: every rank of an SP group must run "
        "the same model on the same micro-batch (FSDPEngine broadcasts it; see docs/troubleshooting.md)"
    )
