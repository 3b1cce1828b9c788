"""Prompt data: ``.txt`` (one prompt a line) or ``.jsonl`` (``{"prompt": ..., other fields}``) files, read into rows,
and the order a run visits them in. A ``.jsonl`` row may name condition images (``"image": "path"`` or
``"images": [...]``, relative to the file's folder: ``images.py``) for the editing and image-to-video families.

The training stream is every row once per epoch, in an order shuffled per epoch from ``train.seed``: position ``i``
of the stream is row ``perm(epoch = i // N)[i % N]``. Each iteration takes the next ``dp x prompts_per_rank``
positions; data-parallel rank ``r`` takes its own ``prompts_per_rank`` of them. The order is a function of the seed
alone, so the ranks of an SP group (which share a dp rank) get the same prompts, and a run resumed from a checkpoint
continues at the stored position, mid-epoch included, on any layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from .images import MAX_IMAGE_PIXELS, resolve_images

__all__ = ["PromptRow", "PromptStream", "read_prompts"]


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other fields (what rewards read)
    images: tuple[str, ...] = ()  # absolute paths of the row's condition images (``image`` / ``images``)
    where: str = field(default="", compare=False)  # "file:line", for errors


def read_prompts(path: str | Path, key: str = "data.train", max_pixels: int = MAX_IMAGE_PIXELS) -> list[PromptRow]:
    """The rows of a ``.txt`` or ``.jsonl`` prompt file (blank lines skipped); errors name ``key``, file and line,
    and a row's images are checked here, each at most ``max_pixels`` (``data.max_image_pixels``; every rank reads
    the file: every rank refuses it alike)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}={str(path)!r}: no such file; fix: a .txt (one prompt a line) or .jsonl file")
    rows: list[PromptRow] = []
    if p.suffix == ".txt":
        lines = p.read_text(encoding="utf-8").splitlines()
        rows = [PromptRow(line.strip(), where=f"{p}:{n}") for n, line in enumerate(lines, start=1) if line.strip()]
    elif p.suffix == ".jsonl":
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ConfigError(f"{key}: {p}:{n} is not JSON ({err}); fix: one JSON object per line") from err
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ConfigError(
                    f'{key}: {p}:{n} has no "prompt" string; fix: each line {{"prompt": "...", other fields}}'
                )
            where = f"{p}:{n}"
            images = resolve_images(row, p.parent, where, key, max_pixels)
            rows.append(
                PromptRow(row["prompt"], {k: v for k, v in row.items() if k != "prompt"}, images, where)
            )
    else:
        raise ConfigError(f"{key}={str(path)!r}: unknown format {p.suffix!r}; fix: a .txt or .jsonl file")
    if not rows:
        raise ConfigError(f"{key}={str(path)!r} holds no prompts; fix: at least one non-empty line")
    return rows


def _epoch_seed(seed: int, epoch: int) -> int:
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + 0x5EED) % (2**63 - 1)


class PromptStream:
    """Rows in an order reshuffled every epoch from ``seed``; ``rows_at(start, count)`` reads positions."""

    def __init__(self, rows: list[PromptRow], seed: int) -> None:
        self.rows, self.seed = list(rows), int(seed)
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of epoch ``epoch`` (the same on every rank and every run with this seed)."""
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.rows), generator=g))
        return self._order[1]

    def row(self, position: int) -> PromptRow:
        epoch, index = divmod(int(position), len(self.rows))
        return self.rows[int(self.order(epoch)[index])]

    def rows_at(self, start: int, count: int) -> list[PromptRow]:
        return [self.row(start + i) for i in range(count)]
