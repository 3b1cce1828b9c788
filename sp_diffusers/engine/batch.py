"""Batches for an SP group: ragged text made dense, on the device, identical on every SP rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import to_device
from ..parallel.padding import pad_text_batch
from .protocols import BatchOwner

__all__ = ["TEXT_KEYS", "broadcast_in_sp_group", "prepare_batch"]

TEXT_KEYS = (
    ("prompt_embeds", "prompt_embeds_mask"),
    ("negative_prompt_embeds", "negative_prompt_embeds_mask"),
    # a second text stream (HunyuanVideo-1.5's byT5 glyph states), padded as the first
    ("prompt_embeds_2", "prompt_embeds_mask_2"),
    ("negative_prompt_embeds_2", "negative_prompt_embeds_mask_2"),
)


def prepare_batch(engine: BatchOwner, batch: dict[str, Any]) -> dict[str, Any]:
    """Dense, on-device, identical on every SP rank (see ``FSDPEngine.prepare_batch``)."""
    compiled = engine.settings.compile != "off"  # length buckets: a few shapes, each one graph
    multiple = engine.sp_size if engine.settings.pad_text_to_degree or compiled else 1
    # on the device first (lists of ragged tensors too), so padding runs there and makes nothing on the CPU
    out = {k: to_device(v, engine.device) for k, v in batch.items()}
    for emb_key, mask_key in TEXT_KEYS:
        if emb_key in out and out[emb_key] is not None:
            out[emb_key], out[mask_key] = pad_text_batch(
                out[emb_key], out.get(mask_key), multiple, emb_key, bucket=compiled
            )
    if engine.debug_checks:
        engine.verify_sp_consistency(out, "batch (before broadcast)")
    return broadcast_in_sp_group(engine, out)


def broadcast_in_sp_group(engine: BatchOwner, tensors: dict[str, Any]) -> dict[str, Any]:
    """Every tensor (and list of tensors) as the SP group's first rank has it, on the engine's device.

    The description (keys, shapes, dtypes, plain values) goes over the SP group's host-side group (gloo: no
    device round trip), the tensors over the SP group itself."""
    if engine.sp_group is None or engine.sp_size == 1:
        return tensors
    src = engine.sp_src_global_rank()
    meta = [{k: _describe(v) for k, v in tensors.items()}]
    dist.broadcast_object_list(meta, src=src, group=engine.sp_control_group)
    return {
        key: _broadcast_value(tensors.get(key), desc, src, engine.sp_group, engine.device)
        for key, desc in meta[0].items()
    }


def _describe(value: Any) -> Any:
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
        return ("tensors", [(tuple(v.shape), v.dtype) for v in value])
    return ("object", value)


def _broadcast_value(value: Any, desc: Any, src: int, group, device: torch.device) -> Any:
    kind = desc[0]
    if kind == "object":
        return desc[1]
    mine = dist.get_rank() == src
    if kind == "tensor":
        _, shape, dtype = desc
        t = to_device(value, device).contiguous() if mine else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        return t
    items = []
    for i, (shape, dtype) in enumerate(desc[1]):
        t = (
            to_device(value[i], device).contiguous()
            if mine
            else torch.empty(shape, dtype=dtype, device=device)
        )
        dist.broadcast(t, src=src, group=group)
        items.append(t)
    return items
