"""Prompt encodings kept by prompt: each unique prompt (and classifier-free guidance's empty prompt) goes
through the text encoders once per run, however many samples, iterations and epochs use it; an image-conditioned
family's rows (a prompt with its images) go through the text encoder, the VAE and the image encoder once per run
too (:class:`ConditionCache`).

A run's encoder and its settings (model, ``text.max_sequence_length``, dtype) are fixed, so an entry is keyed
by its prompt; entries are kept least-recently-used first out under ``text.cache_mb``. With the whole prompt
set encoded up front (:meth:`PromptCache.encode_all`: ``text.offload: after_cache``, or a compiled model, which
pads text to the longest prompt's length bucket), the text encoders can leave the GPU for the rest of the run.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ConditionCache", "PromptCache", "cat_padded"]


def cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` ``[R_i, N_i, ...]`` concatenated along dim 0, each zero-padded at the end of dim 1 to the largest
    ``N_i`` (an image-conditioned batch whose rows have different numbers of condition images: their condition
    tokens and source pixels); the plain ``torch.cat`` where they agree."""
    longest = max(t.shape[1] for t in tensors) if tensors and tensors[0].dim() > 1 else 0
    if all(t.dim() < 2 or t.shape[1] == longest for t in tensors):
        return torch.cat(tensors)
    parts = []
    for t in tensors:
        pad = t.new_zeros((t.shape[0], longest - t.shape[1], *t.shape[2:]))
        parts.append(torch.cat([t, pad], dim=1) if pad.shape[1] else t)
    return torch.cat(parts)


@dataclass(frozen=True)
class _Entry:
    embeds: torch.Tensor  # [L, D]
    mask: torch.Tensor  # [L] bool
    pooled: torch.Tensor | None  # [P] (SD3, FLUX.1)
    embeds_2: torch.Tensor | None = None  # [L2, D2]: a second text stream (HunyuanVideo-1.5's byT5)
    mask_2: torch.Tensor | None = None  # [L2] bool

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.embeds, self.mask, self.pooled, self.embeds_2, self.mask_2) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class PromptCache:
    """``encode_batch(prompts, prefix)`` as the text encoder's, encoding only prompts it has not kept.

    ``limit_mb`` <= 0 turns keeping off (every call encodes). ``seconds`` is the time spent in the encoder,
    ``encoded`` the prompts it encoded (both cumulative)."""

    def __init__(self, encoder: Any, limit_mb: float) -> None:
        self.encoder, self.limit = encoder, int(limit_mb * 2**20)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.seconds, self.encoded = 0.0, 0

    def encode_batch(self, prompts: list[str], prefix: str = "") -> dict[str, Any]:
        if self.limit <= 0:
            return self._encode(prompts, prefix)
        kept = {p: self._entries[p] for p in dict.fromkeys(prompts) if p in self._entries}
        for p in kept:  # most recently used last
            self._entries.move_to_end(p)
        found = {**kept, **self._encode_missing(prompts)}  # (new entries may push kept ones out: held here)
        entries = [found[p] for p in prompts]
        out: dict[str, Any] = {
            f"{prefix}prompt_embeds": [e.embeds for e in entries],
            f"{prefix}prompt_embeds_mask": [e.mask for e in entries],
        }
        if entries and entries[0].pooled is not None:
            out[f"{prefix}pooled_prompt_embeds"] = torch.stack([e.pooled for e in entries])
        if entries and entries[0].embeds_2 is not None:
            out[f"{prefix}prompt_embeds_2"] = [e.embeds_2 for e in entries]
            out[f"{prefix}prompt_embeds_mask_2"] = [e.mask_2 for e in entries]
        return out

    def encode_all(self, prompts: Iterable[str], chunk: int = 16) -> int:
        """Encode every prompt of ``prompts`` not kept yet, ``chunk`` at a time; returns the longest encoding's
        length. Refused where the set does not fit ``text.cache_mb``: a later entry would push out an earlier."""
        unique = list(dict.fromkeys(prompts))
        for start in range(0, len(unique), chunk):
            self._encode_missing(unique[start : start + chunk])
        if any(p not in self._entries for p in unique):
            need = self._bytes / max(len(self._entries), 1) * len(unique) / 2**20
            raise ValueError(
                f"text.cache_mb={self.limit / 2**20:g} holds {len(self._entries)} of the run's {len(unique)} "
                f"prompts; fix: text.cache_mb={need:.0f} or more, or text.offload=never and train.compile=off"
            )
        return max((self._entries[p].embeds.shape[0] for p in unique), default=0)

    def _encode(self, prompts: list[str], prefix: str = "") -> dict[str, Any]:
        start = time.perf_counter()
        out = self.encoder.encode_batch(prompts, prefix=prefix)
        self.seconds += time.perf_counter() - start
        self.encoded += len(prompts)
        return out

    def _encode_missing(self, prompts: list[str]) -> dict[str, _Entry]:
        missing = [p for p in dict.fromkeys(prompts) if p not in self._entries]
        if not missing:
            return {}
        out = self._encode(missing)
        pooled = out.get("pooled_prompt_embeds")
        embeds_2, mask_2 = out.get("prompt_embeds_2"), out.get("prompt_embeds_mask_2")
        fresh = {
            p: _Entry(  # each its own storage: a view would keep the whole batch alive
                out["prompt_embeds"][i].clone(),
                out["prompt_embeds_mask"][i].clone(),
                pooled[i].clone() if pooled is not None else None,
                embeds_2[i].clone() if embeds_2 is not None else None,
                mask_2[i].clone() if mask_2 is not None else None,
            )
            for i, p in enumerate(missing)
        }
        for p, entry in fresh.items():
            self._entries[p] = entry
            self._bytes += entry.nbytes
        while self._bytes > self.limit and self._entries:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
        return fresh


def _host(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def _nbytes(value: Any) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0  # a host int (a row's condition_counts)


class ConditionCache:
    """``encode(rows, encode_rows)``: an image-conditioned batch's entries (text, ``condition_*``, source pixels),
    each row encoded once per run by ``encode_rows(missing rows)`` and kept by its prompt and images, least recently
    used first out under ``limit_mb`` (<= 0: every call encodes). Every entry of the batch dict is per row: a
    ``[R, ...]`` tensor or a list of R items. ``seconds``: time in ``encode_rows``; ``encoded``: rows encoded."""

    def __init__(self, limit_mb: float) -> None:
        self.limit = int(limit_mb * 2**20)
        self._entries: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
        self._bytes = 0
        self.seconds, self.encoded = 0.0, 0

    @staticmethod
    def key(row: Any) -> tuple:
        return (row.prompt, tuple(row.images))

    def encode(self, rows: list[Any], encode_rows: Any) -> dict[str, Any]:
        if self.limit <= 0:
            return self._encode(rows, encode_rows)
        keys = [self.key(r) for r in rows]
        found = {k: self._entries[k] for k in dict.fromkeys(keys) if k in self._entries}
        for k in found:
            self._entries.move_to_end(k)
        missing = {k: r for k, r in zip(keys, rows, strict=True) if k not in found}
        if missing:
            batch = self._encode(list(missing.values()), encode_rows)
            for i, k in enumerate(missing):
                # each row its own storage on the host (a view would keep the whole batch alive; the batch moves to
                # the device when it is prepared, as the text cache's entries do)
                entry = {
                    n: v[i : i + 1].detach().to("cpu", copy=True) if torch.is_tensor(v) else [_host(v[i])]
                    for n, v in batch.items()
                }
                found[k] = self._entries[k] = entry
                self._bytes += _nbytes(list(entry.values()))
            while self._bytes > self.limit and self._entries:
                _, old = self._entries.popitem(last=False)
                self._bytes -= _nbytes(list(old.values()))
        entries = [found[k] for k in keys]
        return {  # rows with fewer condition images than others: zero-padded (conditioning.ConditionEncoder.fitted)
            n: cat_padded([e[n] for e in entries]) if torch.is_tensor(v) else [x for e in entries for x in e[n]]
            for n, v in entries[0].items()
        }

    def _encode(self, rows: list[Any], encode_rows: Any) -> dict[str, Any]:
        start = time.perf_counter()
        out = encode_rows(rows)
        self.seconds += time.perf_counter() - start
        self.encoded += len(rows)
        return out
